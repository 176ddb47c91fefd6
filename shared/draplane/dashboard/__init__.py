"""`draplane dashboard`: a live map of the cluster's devices and the pods still pending.

`device_map` (pure) turns what NATS says into the map; `scheduling_facts` (pure) remembers, in
bounded memory, what the scheduling messages and audit events said about pods; `server` is the
thin aiohttp and NATS shell that feeds both and pushes the map to browsers over server-sent
events; `static/` is the page (plain HTML, CSS and JS, no build step).
"""
