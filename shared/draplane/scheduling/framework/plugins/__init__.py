"""kube-scheduler's plugins, one module each, named as kube-scheduler names them
(`k8s.io/kubernetes/pkg/scheduler/framework/plugins`). `runtime.DEFAULT_FILTERS` lists them in
the default profile's order."""
