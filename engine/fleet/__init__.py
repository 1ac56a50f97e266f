"""A fleet of sloserve replicas on Ray Serve (docs/design.md, "Past one replica").

The replica reports its load (engine.load.load_report), the router predicts each request's TTFT
on every replica from those reports (engine.load.prediction, `routing`), admission refuses what
no replica can serve in time (`admission`), and the autoscaling policy follows predicted
attainment (`autoscaling`). Only the modules that name Ray (`replica`, `ingress`, `ray_router`, `launch`)
import it, and only they need the `cluster` extra.
"""
