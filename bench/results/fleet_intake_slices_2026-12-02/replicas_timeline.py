import json,sys,collections
for run in sys.argv[1:]:
    d=json.load(open(f'{run}/flood.json'))
    t0=min(r['sent_at'] for r in d['requests'])
    by=collections.defaultdict(list)
    for r in sorted(d['requests'],key=lambda r:r['index']):
        if r['status']!=200: continue
        m=r['server_metrics']
        by[r['replica']].append(f"{r['kind'][0]}{r['index']}:{round((m['arrival_time']-t0)*1e3)}>{round((m['first_token_time']-t0)*1e3)}" + ('' if r['kind'][0]=='r' else ('+' if r['ttft_ms']<=r['ttft_slo_ms'] else '-')))
    print('==',run)
    for k,v in by.items(): print('  ',k,' '.join(v))
