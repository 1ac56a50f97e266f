"""Where a host's CPU goes while a command runs: CPU seconds of each process the command starts
(a fleet's ingress, its replicas, their EngineCores, Ray's own daemons, the benchmark's client),
sampled from Linux's /proc, over the whole run and over the window of a `sloserve bench flood`
in it.

    python -m bench.diagnostics.process_cpu --output-dir DIR -- \\
        sloserve bench flood --replicas 3 --on-doomed reject --output-dir DIR/flood

A flood's urgent turns are decided in its first few hundred milliseconds, so the flood's
window is also cut at `--early-s` after its first send: what every process took from the two
cores while those turns waited. Writes DIR/process_cpu.json (every sample) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path



@dataclass
class ProcessTrack:
    pid: int
    kind: str
    title: str
    parent: int
    # (time.time(), user + system CPU seconds) as sampled.
    samples: list[tuple[float, float]] = field(default_factory=list)

    def cpu_at(self, when: float) -> float:
        """CPU seconds used by `when`, linear between samples (before the first sample: the
        first, so that no time before the process was seen counts)."""
        if not self.samples:
            return 0.0
        if when <= self.samples[0][0]:
            return self.samples[0][1]
        for (t0, c0), (t1, c1) in zip(self.samples, self.samples[1:]):
            if when <= t1:
                return c0 + (c1 - c0) * (when - t0) / max(t1 - t0, 1e-9)
        return self.samples[-1][1]

    def used(self, start: float, end: float) -> float:
        return max(0.0, self.cpu_at(end) - self.cpu_at(start))


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """The process's parent and its user + system CPU seconds (Linux's /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) * _TICK_S


def _title(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return None


def kind_of(title: str, pid: int, parent: int, root_pid: int,
            tracks: dict[int, ProcessTrack]) -> str:
    """A reader's name for the process: Ray's actors by their class, EngineCores by their
    parent (a replica's, or the server's)."""
    if pid == root_pid:
        return "client (the command)"
    if "SloserveIngress" in title:
        return "fleet ingress"
    if "SloserveEngine" in title:
        return "replica (API server)"
    if "ServeController" in title or "ProxyActor" in title:
        return "ray serve (controller, proxy)"
    if "multiprocessing" in title or "EngineCore" in title:
        owner = tracks.get(parent)
        return ("server's engine core" if owner is not None and owner.kind == "server (API)"
                else "engine core")
    if "sloserve" in title and " serve" in title:
        return "server (API)"
    if title.startswith("ray::") or "/ray/" in title or "raylet" in title:
        return "ray (other)"
    return "other"


def sample(root_pid: int, tracks: dict[int, ProcessTrack]) -> None:
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            stats[int(entry)] = stat
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    now = time.time()
    family, queue = [], [root_pid]
    while queue:
        pid = queue.pop()
        if pid in stats:
            family.append(pid)
            queue.extend(children.get(pid, ()))
    for pid in family:
        parent, cpu_s = stats[pid]
        track = tracks.get(pid)
        if track is None or track.kind in ("other", "ray (other)"):
            # A Ray worker takes its actor's title once the actor is placed on it; a process
            # that is exiting reads as no title, which names nothing.
            title = _title(pid)
            if title is None:
                continue
            kind = kind_of(title, pid, parent, root_pid, tracks)
            if track is None:
                track = tracks[pid] = ProcessTrack(pid, kind, title, parent)
            elif title and kind != "other":
                track.kind, track.title = kind, title
        track.samples.append((now, cpu_s))


def flood_window(flood_json: Path) -> tuple[float, float] | None:
    """The first send and the last response's end of a `sloserve bench flood` record."""
    if not flood_json.exists():
        return None
    records = json.loads(flood_json.read_text())["requests"]
    sent = [r["sent_at"] for r in records if r.get("sent_at")]
    ends = [r["sent_at"] + (r.get("e2e_ms") or 0.0) / 1e3 for r in records if r.get("sent_at")]
    return (min(sent), max(ends)) if sent else None


def table(tracks: dict[int, ProcessTrack], start: float, end: float) -> dict[str, float]:
    by_kind: dict[str, float] = {}
    for track in tracks.values():
        by_kind[track.kind] = by_kind.get(track.kind, 0.0) + track.used(start, end)
    return dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--interval-s", type=float, default=0.1)
    parser.add_argument("--early-s", type=float, default=0.6,
                        help="the flood's first seconds, reported apart (default 0.6)")
    parser.add_argument("--flood-json", type=Path, default=None,
                        help="the flood's record (default: OUTPUT_DIR/flood/flood.json)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    tracks: dict[int, ProcessTrack] = {}
    began = time.time()
    child = subprocess.Popen(command)
    while child.poll() is None:
        sample(child.pid, tracks)
        time.sleep(args.interval_s)
    ended = time.time()

    windows = {"whole run": (began, ended)}
    flood = flood_window(args.flood_json or args.output_dir / "flood" / "flood.json")
    if flood is not None:
        windows["flood"] = flood
        windows[f"flood's first {args.early_s:g} s"] = (flood[0], flood[0] + args.early_s)
    sampler = os.times()
    report: dict = {"sampler_cpu_s": round(sampler.user + sampler.system, 3)}
    report |= {name: {"seconds": round(end - start, 3),
                     "cpu_s_by_kind": {k: round(v, 3) for k, v in
                                       table(tracks, start, end).items()}}
              for name, (start, end) in windows.items()}
    (args.output_dir / "process_cpu.json").write_text(json.dumps({
        "command": command, "report": report,
        "processes": [{"pid": t.pid, "parent": t.parent, "kind": t.kind, "title": t.title,
                       "samples": t.samples}
                      for t in tracks.values()]}))
    print(f"the sampler itself took {report['sampler_cpu_s']:.2f} CPU seconds")
    for name, row in report.items():
        if name == "sampler_cpu_s":
            continue
        cores = os.cpu_count()
        print(f"CPU seconds by process, {name} ({row['seconds']:.2f} s; {cores} cores give "
              f"{cores * row['seconds']:.2f}):")
        for kind, cpu_s in row["cpu_s_by_kind"].items():
            print(f"  {kind:<28} {cpu_s:7.2f}")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
