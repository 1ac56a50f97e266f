import json,sys
d=json.load(open(sys.argv[1]))
recs=d['requests']
t0=min(r['sent_at'] for r in recs)
print("idx kind  slo  sent writ arriv first(srv) ttfb ttft  replica")
for r in sorted(recs,key=lambda r:r['index']):
    if r['status']!=200: continue
    m=r['server_metrics'] or {}
    a=(m.get('arrival_time',0)-t0)*1000; f=(m.get('first_token_time',0)-t0)*1000
    s=(r['sent_at']-t0)*1000
    print(f"{r['index']:3d} {r['kind'][:3]} {r['ttft_slo_ms']:7.0f} {s:5.1f} {s+r['written_ms']:5.1f} {a:6.1f} {f:7.1f} {s+r['ttfb_ms']:7.1f} {s+r['ttft_ms']:7.1f} {r['replica']}")
