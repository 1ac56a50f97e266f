import json, sys, collections
d = json.load(open(sys.argv[1]))
frames = d["shared"]["frames"]
lo, hi, bucket = (int(x) for x in sys.argv[2:5])
threads = sys.argv[5:]
IDLE = ("Thread.run:982", "_worker:81", "_run_router", "Worker.main_loop", "Condition.wait", "select:", "epoll")
for p in d["profiles"]:
    if not any(t in p["name"] for t in threads): continue
    samples = p["samples"]
    print("==", p["name"])
    for b in range(lo // 4, min(len(samples), hi // 4), bucket):
        c = collections.Counter(); busy = 0
        for s in samples[b:b + bucket]:
            names = [frames[i]["name"] + ":" + str(frames[i].get("line", "")) for i in s]
            files = [frames[i].get("file", "") for i in s]
            leaf = names[-1] if names else "?"
            if any(leaf.startswith(x) for x in IDLE): continue
            busy += 1
            ours = [n for n, f in zip(names, files) if "/work/main/" in f]
            c[(ours[-1][:45] if ours else "-") + "|" + leaf[:45]] += 1
        top = "; ".join(f"{n} {k}" for k, n in c.most_common(3))
        print(f"{b*4:5d}ms busy {busy}/{bucket} {top}")
