// Runs Kubernetes' structured allocator (k8s.io/dynamic-resource-allocation/structured), as an
// oracle for draplane's allocator core (tests/shared/allocation/test_allocator_kubernetes_parity.py).
//
// Input (stdin): one JSON case per line:
//
//	{"node": <v1 Node>, "slices": [<ResourceSlice>], "classes": [<DeviceClass>],
//	 "claims": [<pending ResourceClaim>], "allocated": [<ResourceClaim with status.allocation>]}
//
// Output (stdout): one JSON line per case:
//
//	{"outcome": "allocated"|"unallocatable"|"error", "message": "...", "allocations": [<AllocationResult>]}
//
// The allocator is called the way kube-scheduler's DynamicResources plugin calls it: the allocated
// state is gathered from the allocated claims as its claim tracker does (admin-access results skipped,
// shared results by share ID and consumed capacity), every DRA feature of the allocator is on, and
// CEL expressions go through a real cache. "unallocatable" is no error and no result, or an error
// wrapping ErrFailedAllocationOnNode (kube-scheduler: unschedulable on this node); any other error
// is "error" (kube-scheduler aborts the scheduling attempt).
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/utils/ptr"
)

type input struct {
	Node      *v1.Node                     `json:"node"`
	Slices    []*resourceapi.ResourceSlice `json:"slices"`
	Classes   []*resourceapi.DeviceClass   `json:"classes"`
	Claims    []*resourceapi.ResourceClaim `json:"claims"`
	Allocated []*resourceapi.ResourceClaim `json:"allocated"`
}

type output struct {
	Outcome     string                         `json:"outcome"`
	Message     string                         `json:"message,omitempty"`
	Allocations []resourceapi.AllocationResult `json:"allocations"`
}

// classLister is what the plugin's DeviceClasses() lister gives: Get fails with NotFound.
type classLister map[string]*resourceapi.DeviceClass

func (l classLister) List() ([]*resourceapi.DeviceClass, error) {
	out := make([]*resourceapi.DeviceClass, 0, len(l))
	for _, c := range l {
		out = append(out, c)
	}
	return out, nil
}

func (l classLister) Get(name string) (*resourceapi.DeviceClass, error) {
	if c, ok := l[name]; ok {
		return c, nil
	}
	return nil, apierrors.NewNotFound(resourceapi.Resource("deviceclasses"), name)
}

// allocatedState mirrors the plugin's allocatedDevices.addDevices + claimTracker.GatherAllocatedState
// (pkg/scheduler/framework/plugins/dynamicresources, DRAConsumableCapacity on).
func allocatedState(claims []*resourceapi.ResourceClaim) structured.AllocatedState {
	state := structured.AllocatedState{
		AllocatedDevices:         sets.New[structured.DeviceID](),
		AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
		AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
	}
	for _, claim := range claims {
		if claim.Status.Allocation == nil {
			continue
		}
		for _, result := range claim.Status.Allocation.Devices.Results {
			if ptr.Deref(result.AdminAccess, false) {
				continue
			}
			deviceID := structured.MakeDeviceID(result.Driver, result.Pool, result.Device)
			if result.ShareID != nil {
				state.AllocatedSharedDeviceIDs.Insert(structured.MakeSharedDeviceID(deviceID, result.ShareID))
				if result.ConsumedCapacity != nil {
					state.AggregatedCapacity.Insert(structured.NewDeviceConsumedCapacity(deviceID, result.ConsumedCapacity))
				}
				continue
			}
			state.AllocatedDevices.Insert(deviceID)
		}
	}
	return state
}

// Every feature the allocator has (internal.FeaturesAll): kube-scheduler with all DRA gates on.
var featuresAll = structured.Features{
	AdminAccess:             true,
	CompatibilityGroups:     true,
	ConsumableCapacity:      true,
	DerivedAttributes:       true,
	DeviceBindingAndStatus:  true,
	DeviceTaints:            true,
	FractionalCapacityRange: true,
	ListTypeAttributes:      true,
	OptionalNodeOperations:  true,
	PartitionableDevices:    true,
	PrioritizedList:         true,
}

// Same as the plugin's cache (dynamicresources.New), with its features on.
var celCache = cel.NewCache(10, cel.Features{EnableConsumableCapacity: true, EnableListTypeAttributes: true})

func allocate(ctx context.Context, in *input) (out output) {
	defer func() {
		if r := recover(); r != nil {
			out = output{Outcome: "error", Message: fmt.Sprintf("panic: %v", r)}
		}
	}()
	classes := classLister{}
	for _, c := range in.Classes {
		classes[c.Name] = c
	}
	allocator, err := structured.NewAllocator(ctx, featuresAll, allocatedState(in.Allocated), classes, in.Slices, celCache)
	if err != nil {
		return output{Outcome: "error", Message: err.Error()}
	}
	results, err := allocator.Allocate(ctx, in.Node, in.Claims)
	switch {
	case errors.Is(err, structured.ErrFailedAllocationOnNode):
		return output{Outcome: "unallocatable", Message: err.Error()}
	case err != nil:
		return output{Outcome: "error", Message: err.Error()}
	case results == nil:
		return output{Outcome: "unallocatable"}
	}
	return output{Outcome: "allocated", Allocations: results}
}

func main() {
	ctx := context.Background()
	scanner := bufio.NewScanner(os.Stdin)
	scanner.Buffer(make([]byte, 1<<20), 256<<20)
	writer := bufio.NewWriter(os.Stdout)
	encoder := json.NewEncoder(writer)
	for scanner.Scan() {
		var in input
		var out output
		if err := json.Unmarshal(scanner.Bytes(), &in); err != nil {
			out = output{Outcome: "error", Message: "oracle: decode case: " + err.Error()}
		} else {
			out = allocate(ctx, &in)
		}
		if err := encoder.Encode(out); err != nil {
			panic(err)
		}
		if err := writer.Flush(); err != nil {
			panic(err)
		}
	}
	if err := scanner.Err(); err != nil {
		panic(err)
	}
}
