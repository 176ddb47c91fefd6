"""kube-scheduler's scheduling framework, as draplane runs it for one pod.

- `interface`: what passes between the extension points (a node's view, a plugin's rejection);
- `plugins`: one module per plugin of kube-scheduler's default profile, named as it names them,
  each with its extension points as functions (`pre_enqueue`, `pre_filter`, `filter`, `score`,
  `reserve`/`unreserve`, `pre_bind`) and its reason strings;
- `runtime`: the profile, and one scheduling cycle through it in kube-scheduler's order.

This package imports nothing here: the plugins import `interface`, and `runtime` imports them.
"""
