import json, collections, sys
d = json.load(open(sys.argv[1]))
recs = d["requests"]
t0 = min(r["sent_at"] for r in recs if r.get("sent_at"))
rows = collections.defaultdict(list)
for line in open(sys.argv[2]):
    t, pid, ticks, name = line.rstrip("\n").split("\t", 3)
    rows[pid].append((float(t), int(ticks), name if name.strip() else (rows[pid][-1][2] if rows[pid] else name)))
def at(series, t):
    v = series[0][1]
    for tt, ti, _ in series:
        if tt <= t: v = ti
    return v
wins = [tuple(map(float, w.split(":"))) for w in sys.argv[3:]] or [(-2, 0), (0, 0.5), (0.5, 1.0), (1.0, 4.5)]
for lo, hi in wins:
    tot = {}
    for pid, s in rows.items():
        d_ = at(s, t0 + hi) - at(s, t0 + lo)
        if d_ > 0: tot[pid] = (d_, s[-1][2])
    print(f"--- window {lo}..{hi}s: total {sum(v[0] for v in tot.values())*10} ms CPU")
    for pid, (v, n) in sorted(tot.items(), key=lambda x: -x[1][0])[:14]:
        print(f"{v*10:6d} ms  {pid:>7} {n[:100]}")
