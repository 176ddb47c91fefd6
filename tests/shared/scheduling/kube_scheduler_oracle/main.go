// Runs kube-scheduler's own framework (k8s.io/kubernetes/pkg/scheduler, default profile) over a
// snapshot of objects, as an oracle for draplane's pod-level filters
// (tests/shared/scheduling/test_kube_scheduler_parity.py, bench/scheduler_parity.py).
//
// Input (stdin): one JSON case per line:
//
//	{"nodes": [<v1 Node>], "pods": [<v1 Pod bound to a node>], "pod": <the pending v1 Pod>,
//	 "volumes": [<PersistentVolume>], "claims": [<PersistentVolumeClaim>], "storageClasses": [<StorageClass>],
//	 "csiNodes": [<CSINode>], "csiDrivers": [<CSIDriver>], "volumeAttachments": [<VolumeAttachment>],
//	 "services": [<Service>], "replicaSets": [<ReplicaSet>], "statefulSets": [<StatefulSet>],
//	 "replicationControllers": [<ReplicationController>]}
//
// Output (stdout): one JSON line per case:
//
//	{"feasible": ["node", ...], "reasons": {"node": ["reason", ...]}, "message": "0/N nodes are available: ...",
//	 "error": "..."}
//
// The cycle is kube-scheduler's findNodesThatFitPod without its shortcuts: PreFilter, then every
// node through the Filter plugins (not only as many as it needs to score), with the statuses
// gathered into a FitError as schedule_one.go does. "message" is that FitError's text, the part
// the filters write (PostFilter's preemption note is not included). "error" is a plugin error,
// which ends kube-scheduler's attempt.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apiserver/pkg/util/feature"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/events"
	resourceslicetracker "k8s.io/dynamic-resource-allocation/resourceslice/tracker"
	"k8s.io/klog/v2"
	configv1 "k8s.io/kube-scheduler/config/v1"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/features"
	schedulerapi "k8s.io/kubernetes/pkg/scheduler/apis/config"
	"k8s.io/kubernetes/pkg/scheduler/apis/config/scheme"
	internalcache "k8s.io/kubernetes/pkg/scheduler/backend/cache"
	"k8s.io/kubernetes/pkg/scheduler/framework"
	frameworkplugins "k8s.io/kubernetes/pkg/scheduler/framework/plugins"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/dynamicresources"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/nodevolumelimits"
	frameworkruntime "k8s.io/kubernetes/pkg/scheduler/framework/runtime"
	"k8s.io/kubernetes/pkg/scheduler/metrics"
	"k8s.io/kubernetes/pkg/scheduler/util/assumecache"
)

type input struct {
	Nodes          []*v1.Node                    `json:"nodes"`
	Pods           []*v1.Pod                     `json:"pods"`
	Pod            *v1.Pod                       `json:"pod"`
	Volumes        []*v1.PersistentVolume        `json:"volumes"`
	Claims         []*v1.PersistentVolumeClaim   `json:"claims"`
	StorageClasses []*storagev1.StorageClass     `json:"storageClasses"`
	CSINodes       []*storagev1.CSINode          `json:"csiNodes"`
	CSIDrivers     []*storagev1.CSIDriver        `json:"csiDrivers"`
	Attachments    []*storagev1.VolumeAttachment `json:"volumeAttachments"`
	Services       []*v1.Service                 `json:"services"`
	ReplicaSets    []*appsv1.ReplicaSet          `json:"replicaSets"`
	StatefulSets   []*appsv1.StatefulSet         `json:"statefulSets"`
	Controllers    []*v1.ReplicationController   `json:"replicationControllers"`
	// ask for the profile's plugins at PreEnqueue and Filter, in the order they run
	ListPlugins bool `json:"listPlugins"`
}

type output struct {
	Feasible []string            `json:"feasible"`
	Reasons  map[string][]string `json:"reasons"`
	Message  string              `json:"message,omitempty"`
	// feasible node -> scoring plugin -> its normalized, weighted score (InterPodAffinity and
	// PodTopologySpread only: the two that read other pods)
	Scores map[string]map[string]int64 `json:"scores,omitempty"`
	Error  string                      `json:"error,omitempty"`
	// with listPlugins: extension point -> its plugins, in order
	Plugins map[string][]string `json:"plugins,omitempty"`
}

// noNominations: no pod of a case is nominated to a node (the scheduling queue would say which).
type noNominations struct{}

func (noNominations) AddNominatedPod(klog.Logger, fwk.PodInfo, *fwk.NominatingInfo) {}
func (noNominations) DeleteNominatedPodIfExists(*v1.Pod)                            {}
func (noNominations) UpdateNominatedPod(klog.Logger, *v1.Pod, fwk.PodInfo)          {}
func (noNominations) NominatedPodsForNode(string) []fwk.PodInfo                     { return nil }

// defaultProfile is kube-scheduler's default profile, defaulted as scheduler.New defaults it.
func defaultProfile() (*schedulerapi.KubeSchedulerProfile, error) {
	var versioned configv1.KubeSchedulerConfiguration
	scheme.Scheme.Default(&versioned)
	cfg := schedulerapi.KubeSchedulerConfiguration{}
	if err := scheme.Scheme.Convert(&versioned, &cfg, nil); err != nil {
		return nil, err
	}
	return &cfg.Profiles[0], nil
}

func run(ctx context.Context, profile *schedulerapi.KubeSchedulerProfile, in input) output {
	out := output{Feasible: []string{}, Reasons: map[string][]string{}}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	objects := make([]runtime.Object, 0, len(in.Nodes)+len(in.Pods))
	for _, n := range in.Nodes {
		objects = append(objects, n)
	}
	for _, p := range in.Pods {
		objects = append(objects, p)
	}
	for _, v := range in.Volumes {
		objects = append(objects, v)
	}
	for _, c := range in.Claims {
		objects = append(objects, c)
	}
	for _, c := range in.StorageClasses {
		objects = append(objects, c)
	}
	for _, c := range in.CSINodes {
		objects = append(objects, c)
	}
	for _, d := range in.CSIDrivers {
		objects = append(objects, d)
	}
	for _, a := range in.Attachments {
		objects = append(objects, a)
	}
	for _, o := range in.Services {
		objects = append(objects, o)
	}
	for _, o := range in.ReplicaSets {
		objects = append(objects, o)
	}
	for _, o := range in.StatefulSets {
		objects = append(objects, o)
	}
	for _, o := range in.Controllers {
		objects = append(objects, o)
	}
	client := fake.NewSimpleClientset(objects...)
	informerFactory := informers.NewSharedInformerFactory(client, 0)
	logger := klog.FromContext(ctx)

	var draManager fwk.SharedDRAManager
	if feature.DefaultFeatureGate.Enabled(features.DynamicResourceAllocation) {
		claims := assumecache.NewAssumeCache(logger, informerFactory.Resource().V1().ResourceClaims().Informer(), "ResourceClaim", "", nil)
		opts := resourceslicetracker.Options{
			EnableDeviceTaintRules:   feature.DefaultFeatureGate.Enabled(features.DRADeviceTaintRules),
			EnableConsumableCapacity: feature.DefaultFeatureGate.Enabled(features.DRAConsumableCapacity),
			SliceInformer:            informerFactory.Resource().V1().ResourceSlices(),
			KubeClient:               client,
		}
		if opts.EnableDeviceTaintRules {
			opts.TaintInformer = informerFactory.Resource().V1().DeviceTaintRules()
		}
		tracker, err := resourceslicetracker.StartTracker(ctx, opts)
		if err != nil {
			out.Error = fmt.Sprintf("resource slice tracker: %v", err)
			return out
		}
		draManager = dynamicresources.NewDRAManager(ctx, claims, tracker, informerFactory)
	}

	snapshot := internalcache.NewSnapshot(in.Pods, in.Nodes)
	recorder := metrics.NewMetricsAsyncRecorder(1000, time.Second, ctx.Done())
	broadcaster := events.NewFakeRecorder(100)
	schedFramework, err := frameworkruntime.NewFramework(ctx, frameworkplugins.NewInTreeRegistry(), profile,
		frameworkruntime.WithClientSet(client),
		frameworkruntime.WithInformerFactory(informerFactory),
		frameworkruntime.WithSharedDRAManager(draManager),
		frameworkruntime.WithSharedCSIManager(nodevolumelimits.NewCSIManager(informerFactory.Storage().V1().CSINodes().Lister())),
		frameworkruntime.WithSnapshotSharedLister(snapshot),
		frameworkruntime.WithEventRecorder(broadcaster),
		frameworkruntime.WithParallelism(1),
		frameworkruntime.WithMetricsRecorder(recorder),
		frameworkruntime.WithPodNominator(noNominations{}),
	)
	if err != nil {
		out.Error = fmt.Sprintf("framework: %v", err)
		return out
	}
	informerFactory.Start(ctx.Done())
	informerFactory.WaitForCacheSync(ctx.Done())
	if in.ListPlugins {
		listed := schedFramework.ListPlugins()
		out.Plugins = map[string][]string{}
		for point, set := range map[string]*schedulerapi.PluginSet{"PreEnqueue": &listed.PreEnqueue, "Filter": &listed.Filter} {
			names := []string{}
			for _, p := range set.Enabled {
				names = append(names, p.Name)
			}
			out.Plugins[point] = names
		}
	}

	pod := in.Pod
	allNodes, err := snapshot.NodeInfos().List()
	if err != nil {
		out.Error = err.Error()
		return out
	}
	diagnosis := framework.Diagnosis{NodeToStatus: framework.NewDefaultNodeToStatus()}
	fitError := func() string {
		return (&framework.FitError{Pod: pod, NumAllNodes: len(allNodes), Diagnosis: diagnosis}).Error()
	}
	state := framework.NewCycleState()
	preRes, s, unschedulablePlugins := schedFramework.RunPreFilterPlugins(ctx, state, pod)
	diagnosis.UnschedulablePlugins = unschedulablePlugins
	if !s.IsSuccess() {
		if !s.IsRejected() {
			out.Error = s.AsError().Error()
			return out
		}
		diagnosis.NodeToStatus.SetAbsentNodesStatus(s)
		diagnosis.PreFilterMsg = s.Message()
		for _, n := range allNodes {
			out.Reasons[n.Node().Name] = s.Reasons()
		}
		out.Message = fitError()
		return out
	}
	nodes := allNodes
	if !preRes.AllNodes() {
		nodes = nil
		for _, n := range allNodes {
			if preRes.NodeNames.Has(n.Node().Name) {
				nodes = append(nodes, n)
			} else {
				out.Reasons[n.Node().Name] = []string{fmt.Sprintf("node(s) didn't satisfy plugin(s) %v", sets.List(unschedulablePlugins))}
			}
		}
		diagnosis.NodeToStatus.SetAbsentNodesStatus(fwk.NewStatus(fwk.UnschedulableAndUnresolvable,
			fmt.Sprintf("node(s) didn't satisfy plugin(s) %v", sets.List(unschedulablePlugins))))
	}
	var feasibleInfos []fwk.NodeInfo
	for _, nodeInfo := range nodes {
		status := schedFramework.RunFilterPluginsWithNominatedPods(ctx, state, pod, nodeInfo)
		name := nodeInfo.Node().Name
		if status.Code() == fwk.Error {
			out.Error = status.AsError().Error()
			return out
		}
		if status.IsSuccess() {
			out.Feasible = append(out.Feasible, name)
			feasibleInfos = append(feasibleInfos, nodeInfo)
			continue
		}
		diagnosis.NodeToStatus.Set(name, status)
		diagnosis.AddPluginStatus(status)
		out.Reasons[name] = status.Reasons()
	}
	sort.Strings(out.Feasible)
	out.Message = fitError()
	if len(feasibleInfos) > 0 {
		if s := schedFramework.RunPreScorePlugins(ctx, state, pod, feasibleInfos); !s.IsSuccess() {
			out.Error = fmt.Sprintf("prescore: %v", s.AsError())
			return out
		}
		scores, s := schedFramework.RunScorePlugins(ctx, state, pod, feasibleInfos)
		if !s.IsSuccess() {
			out.Error = fmt.Sprintf("score: %v", s.AsError())
			return out
		}
		out.Scores = map[string]map[string]int64{}
		for _, node := range scores {
			byPlugin := map[string]int64{}
			for _, score := range node.Scores {
				if score.Name == "InterPodAffinity" || score.Name == "PodTopologySpread" {
					byPlugin[score.Name] = score.Score
				}
			}
			out.Scores[node.Name] = byPlugin
		}
	}
	return out
}

func main() {
	klog.SetOutput(os.Stderr)
	metrics.Register() // the framework counts into these, as kube-scheduler's New registers them
	profile, err := defaultProfile()
	if err != nil {
		fmt.Fprintln(os.Stderr, "default profile:", err)
		os.Exit(1)
	}
	reader := bufio.NewReaderSize(os.Stdin, 1<<20)
	writer := bufio.NewWriter(os.Stdout)
	encoder := json.NewEncoder(writer)
	for {
		line, err := reader.ReadBytes('\n')
		if len(line) > 0 {
			var in input
			var out output
			if jerr := json.Unmarshal(line, &in); jerr != nil {
				out = output{Error: fmt.Sprintf("decoding the case: %v", jerr)}
			} else {
				out = run(context.Background(), profile, in)
			}
			if eerr := encoder.Encode(out); eerr != nil {
				fmt.Fprintln(os.Stderr, "encoding:", eerr)
				os.Exit(1)
			}
			writer.Flush()
		}
		if err != nil {
			return
		}
	}
}
