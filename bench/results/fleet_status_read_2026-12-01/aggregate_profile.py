import collections,re,sys
path=sys.argv[1]; want=sys.argv[2] if len(sys.argv)>2 else None
tot=collections.Counter(); thr=collections.Counter(); leaf=collections.Counter(); N=0
for line in open(path):
    stack,n=line.rstrip().rsplit(' ',1); n=int(n)
    frames=stack.split(';'); thr[frames[0]]+=n
    if want and want not in frames[0]: continue
    N+=n; seen=set()
    for f in frames[1:]:
        key=re.sub(r' \(.*/site-packages/',' (',f); key=re.sub(r':\d+\)',')',key)
        if key not in seen: tot[key]+=n; seen.add(key)
    leaf[re.sub(r':\d+\)',')',re.sub(r' \(.*/site-packages/',' (',frames[-1]))]+=n
print(thr.most_common(8)); print('N',N)
for k,v in tot.most_common(int(sys.argv[3]) if len(sys.argv)>3 else 50): print(v,k[:140])
print('--- leaf')
for k,v in leaf.most_common(25): print(v,k[:140])
