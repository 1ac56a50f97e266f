import json,sys,glob
run=sys.argv[1]
d=json.load(open(f'/tmp/fl/{run}/flood.json')); recs=d['requests']
t0=min(r['sent_at'] for r in recs)
T=max(glob.glob('/tmp/fl/trace_*.json'), key=lambda f: len(open(f).read()))
T=[e for e in json.load(open(T)) if e[2]>=t0-0.01]
ms=lambda t: round((t-t0)*1e3)
def show(kind, filt=lambda e: True):
    return [ms(e[2]) for e in T if e[0]==kind and filt(e)]
urg=lambda e: e[3] is not None and e[3]<1
doc=lambda e: e[3] is not None and e[3]>1
calls=show('call'); print('calls', len(calls), calls[:3], calls[-3:])
print('urgent remote', show('remote', urg))
print('urgent choose', show('choose', urg))
print('urgent routed', show('routed', urg))
print('doc remote', show('remote', doc)[:6])
print('doc choose', show('choose', doc)[:6])
print('doc routed', show('routed', doc)[:6])
print('updates', [(ms(a[2]), ms(b[2])) for a,b in zip([e for e in T if e[0]=='update'],[e for e in T if e[0]=='updated'])][:12])
rid={e[1]:e for e in T if e[0]=='remote'}
print('urgent start', [ms(e[2]) for e in T if e[0]=='start' and e[1] in rid and urg(rid[e[1]])])
print('first output chunks', sorted(ms(e[2]) for e in T if e[0]=='chunk' and e[3])[:14])
print('client urgent ttft abs', sorted(round((r['sent_at']-t0)*1e3+r['ttft_ms']) for r in recs if r['status']==200 and r['kind']=='urgent'))
print('429 ttfb abs', sorted(round((r['sent_at']-t0)*1e3+r['ttfb_ms']) for r in recs if r['status']==429)[::6])
print('urgent engine first token abs', sorted(round((r['server_metrics']['arrival_time']-t0)*1e3 + r['server_ttft_ms']) for r in recs if r['status']==200 and r['kind']=='urgent'))
R=[]
for f in glob.glob('/tmp/fl/replica_*.json'):
    R += json.load(open(f))
R=[e for e in R if e[1] and e[1]>=t0-0.01]
urg_arr={round(e[2],6) for e in T if e[0]=='call'}
# map arrived_at -> urgent? via ingress remote slo: use ingress 'call' arrived_at and the following remote? approximate by client records server arrival_time
urg_arrivals={round(r['server_metrics']['arrival_time'],3) for r in recs if r['status']==200 and r['kind']=='urgent'}
isu=lambda e: round(e[1],3) in urg_arrivals
print('replica rcall (urgent)', sorted(ms(e[2]) for e in R if e[0]=='rcall' and isu(e)))
print('replica rstart (urgent)', sorted(ms(e[2]) for e in R if e[0]=='rstart' and isu(e)))
first={}
for e in R:
    if e[0]=='rchunk' and isu(e) and e[1] not in first: first[e[1]]=e[2]
print('replica first chunk (urgent)', sorted(ms(v) for v in first.values()))
q=[e for e in T if e[0]=='qput']
print('qput count', len(q), 'threads', set(e[3] for e in q))
print('qput times (first 30)', sorted(ms(e[2]) for e in q)[:30])
