"""Join the ingress trace with a flood.json: per request, ms since the first send."""
import json, sys, collections
flood = json.load(open(sys.argv[1]))
trace = [l.split(None, 3) for l in open(sys.argv[2]) if l.strip()]
recs = flood['requests']
t0 = min(r['sent_at'] for r in recs)
ev = collections.defaultdict(dict)
for parts in trace:
    t, e, idx = float(parts[0]), parts[1], parts[2]
    if idx == '-' or t < t0 - 1:
        continue
    ev[int(idx)].setdefault(e, (t - t0) * 1e3)
cols = ['enter', 'body', 'full', 'hint0', 'hinted', 'doomed', 'forward', 'start', 'respond', 'output']
print('kind idx st  sent ' + ' '.join(f'{c:>7}' for c in cols) + '   arr srvtok  ttfb  ttft slo')
for r in sorted(recs, key=lambda r: r['sent_at']):
    e = ev.get(r['index'], {})
    m = r.get('server_metrics') or {}
    arr = m.get('arrival_time')
    arr_ms = (arr - t0) * 1e3 if arr else None
    tok = arr_ms + r['server_ttft_ms'] if arr_ms is not None and r['server_ttft_ms'] else None
    f = lambda v: f'{v:7.0f}' if isinstance(v, (int, float)) else '      -'
    sent = (r['sent_at'] - t0) * 1e3
    print(f"{r['kind'][:3]} {r['index']:4d} {r['status']} {sent:5.0f} " + ' '.join(f(e.get(c)) for c in cols)
          + f" {f(arr_ms)} {f(tok)} {f(sent + (r['ttfb_ms'] or 0))} {f(sent + r['ttft_ms'] if r['ttft_ms'] else None)} {r['ttft_slo_ms']:.0f}")
