import re,sys,statistics
for path in sys.argv[1:]:
    route={}; size={}; tmpl=[]; fan=[]
    hand=[]
    for line in open(path):
        m=re.match(r"TIMING (\d+) route ([\d.]+) size (\d+)",line)
        if m: route[m[1]]=float(m[2]); size[m[1]]=int(m[3]); continue
        m=re.match(r"TIMING (\d+) templated ([\d.]+)",line)
        if m and m[1] in route and size[m[1]]<4096: tmpl.append(float(m[2])-route[m[1]]); continue
        m=re.search(r"(\d+) prompt tokens, TTFT objective (\d+) ms, handed over ([\d.]+) ms",line)
        if m and int(m[1])<1000 and "warm-up" not in line: hand.append(float(m[3]))
    q=lambda v: f"n={len(v)} median {statistics.median(v):.1f} range {min(v):.1f}-{max(v):.1f}" if v else "-"
    print(path, "| turn route->token ids:", q(tmpl), "| turn arrival->core:", q(hand))
