import json,glob,collections,sys
run=sys.argv[1]
fl=json.load(open(f'runs/{run}/flood.json'))
t0=min(r['sent_at'] for r in fl['requests'])
# urgent accepted: arrival_time keys
urg={}
for r in fl['requests']:
    if r['status']==200:
        m=r['server_metrics']; urg[m['arrival_time']]=(r['kind'][0]+str(r['index']), r['ttft_slo_ms'], m['first_token_time'], r['replica'])
ev=collections.defaultdict(dict)
for f in glob.glob('hops/'+sys.argv[2]+'/*.jsonl'):
    for line in open(f):
        e=json.loads(line)
        if e["arr"] is None:
            continue
        # match to nearest arrival
        k=min(urg, key=lambda a: abs(a-e['arr']))
        if abs(k-e['arr'])>0.002: continue
        ev[k].setdefault(e['ev'], e['t'])
order=['ingress_stamped','ingress_turn','ingress_hinted','ingress_remote','ingress_start','router_choose','router_routed','replica_handle','engine_submit','engine_drained']
print('name  ', ' '.join(f'{o[:14]:>14}' for o in order), '  first_tok  slo')
for k in sorted(urg, key=lambda a: urg[a][0][0]+f'{a}'):
    name,slo,ft,rep=urg[k]
    row=[ev[k].get(o) for o in order]
    print(f'{name:6}', ' '.join(f'{(x-t0)*1e3:14.0f}' if x else f'{"-":>14}' for x in row), f'{(ft-t0)*1e3:9.0f}', slo, rep[:4], f'arr {(k-t0)*1e3:.0f}')
