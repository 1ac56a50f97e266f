"""A server's load as others read it: what an engine reports of its queue (`load_report`), the
hashes of its cached prefix blocks (`prefix_hashes`), a request's predicted TTFT on it
(`prediction`) and what will arrive while the request waits (`arrivals`).

EngineCore builds the report; one server's `--on-doomed reject` (engine.serving.doomed) and a
fleet's router and admission (engine.fleet) predict on it. Pure code over msgspec structs: no
Ray, no HTTP.
"""
