import json,sys
for run in sys.argv[1:]:
    d=json.load(open(f'/tmp/fl/runs/{run}/flood.json'))
    print('==',run)
    for x in sorted(d['requests'], key=lambda x:x['index']):
        if x['status']==200 and x['kind']=='urgent':
            m=x['server_metrics']; s=x['sent_at']
            d1=(m['arrival_time']-s)*1e3; d2=(s+x['ttft_ms']/1e3-m['first_token_time'])*1e3
            print(x['index'],x['replica'][:4], 'slo',x['ttft_slo_ms'],'ttft',round(x['ttft_ms'],1),'MISS' if x['ttft_ms']>x['ttft_slo_ms'] else '    ','wr',round(x['written_ms'],1),'s->a',round(d1,1),'srv',round(m['ttft_ms'],1),'q',round(m['queue_time_ms'],1),'ft->c',round(d2,1),'pred',x['routed_predicted_ttft_ms'],'pre',m['num_slo_preemptions'])
