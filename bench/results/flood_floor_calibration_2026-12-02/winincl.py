import json, sys, collections
d = json.load(open(sys.argv[1])); lo, hi = int(sys.argv[2])//4, int(sys.argv[3])//4; th = sys.argv[4]
frames = d["shared"]["frames"]
IDLE = ("Thread.run:982", "_worker:81", "_run_router", "Worker.main_loop", "Condition.wait", "select:", "epoll")
incl = collections.Counter(); busy = 0
for p in d["profiles"]:
    if th not in p["name"]: continue
    for s in p["samples"][lo:hi]:
        names = [frames[i]["name"] + ":" + str(frames[i].get("line", "")) + "@" + frames[i].get("file", "").split("/")[-1] for i in s]
        if not names or names[-1].startswith(IDLE): continue
        busy += 1
        for n in set(n.split(":")[0] + "@" + n.split("@")[-1] for n in names): incl[n] += 1
print("busy samples", busy)
for k, n in incl.most_common(int(sys.argv[5]) if len(sys.argv) > 5 else 60): print(f"{n:4d} {k}")
