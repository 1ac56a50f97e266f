import json,sys,statistics as st
for f in sys.argv[1:]:
    d=json.load(open(f+'/flood.json')); recs=d['requests']; t0=min(r['sent_at'] for r in recs)
    rows=[]
    for r in recs:
        if r['status']!=200 or r['kind']!='urgent': continue
        m=r['server_metrics']; s=(r['sent_at']-t0)*1e3
        a=(m['arrival_time']-r['sent_at'])*1e3; ft=(m['first_token_time']-m['arrival_time'])*1e3
        rel=r['ttft_ms']-a-ft
        rows.append((a,ft,rel,r['ttft_ms'],r['ttft_ms']<=r['ttft_slo_ms']))
    med=lambda i: st.median(x[i] for x in rows)
    print(f"{f:22s} n={len(rows):2d} in {med(0):5.1f}  server {med(1):6.1f}  relay {med(2):5.1f}  ttft {med(3):6.1f}  met {sum(x[4] for x in rows)}")
