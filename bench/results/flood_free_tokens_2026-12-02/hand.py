import json,sys,re,glob
for run in sys.argv[1:]:
    d=json.load(open(f'/tmp/fl/runs/{run}/flood.json'))
    hand={}
    for f in glob.glob(f'/tmp/fl/runs/{run}/raylogs/worker-*.err'):
        for line in open(f):
            m=re.search(r'request (\S+): (\d+) prompt tokens, TTFT objective (\d+) ms, handed over ([\d.]+) ms',line)
            if m: hand[(int(m.group(2)),int(m.group(3)))]=float(m.group(4))
    print('==',run)
    for x in sorted(d['requests'], key=lambda x:x['index']):
        if x['status']==200 and x['kind']=='urgent':
            m=x['server_metrics']
            h=hand.get((x['usage_prompt_tokens'],round(x['ttft_slo_ms'])))
            print(x['index'],x['replica'][:4],'slo',x['ttft_slo_ms'],'ttft',round(x['ttft_ms'],1),'MISS' if x['ttft_ms']>x['ttft_slo_ms'] else '    ','pre-arr',round((m['arrival_time']-x['sent_at'])*1e3,1),'handover',h,'engine',round(m['ttft_ms']-h,1) if h else None,'after',round(x['ttft_ms']-m['ttft_ms']-(m['arrival_time']-x['sent_at'])*1e3,1),'pre',m['num_slo_preemptions'])
