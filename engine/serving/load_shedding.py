"""Load shedding at the queue bound: while the server holds as many requests as
`--max-num-queued-reqs` allows (waiting, running, or being tokenized: engine.serving.admission),
a generation request is refused with the bound's 429 as soon as its headers are read, before
its body is read, parsed or validated.

Under a flood most requests are refused, and each one's body (a document can be a megabyte of
JSON) parsed only to be refused takes the event loop from the requests being served: ten times
the bound at once, with the bodies parsed, delayed the admitted turns' first steps by hundreds of
milliseconds on a two-core host. A gateway sheds load the same way, before the body. A request
is still read whole while the server has room for one (its own n samples may then be over the
bound: `OpenAIServing.arriving` judges it with its body), and one without the right API key is
left to the app's 401.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from engine.serving.admission import AdmissionLedger, QueueFull, queue_full_headers
from engine.serving.api_errors import error_body, send_json
from engine.serving.api_key import key_matches

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})


class QueueShed:
    def __init__(self, app: ASGIApp, ledger: AdmissionLedger,
                 expected_authorization: Callable[[], bytes | None]) -> None:
        self.app, self.ledger = app, ledger
        self._expected_authorization = expected_authorization

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope.get("method") == "POST"
                and scope.get("path") in GENERATION_PATHS and self._authorized(scope)):
            try:
                self.ledger.check_room(1)
            except QueueFull as exc:
                return await send_json(send, 429, error_body(str(exc), 429),
                                       queue_full_headers(exc.reason))
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = next((v for k, v in scope.get("headers") or () if k == b"authorization"), b"")
        return key_matches(given, self._expected_authorization())
