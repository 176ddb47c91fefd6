// Evaluates DRA CEL selectors with Kubernetes' own compiler, as an oracle for draplane's tests.
// Input (stdin): JSON {"devices": {name: {driver, allowMultipleAllocations, attributes: {qualifiedName: {int|bool|string|version}}, capacity: {qualifiedName: "quantity"}}}, "cases": [{"expression", "device", "raw"}]}
// Output (stdout): JSON list of {"compileError", "result", "runtimeError", "maxCost"}, and for a
// raw case {"value", "type"}: the result of any type, printed with Go's %#v.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	dracel "k8s.io/dynamic-resource-allocation/cel"
)

type attr struct {
	Int     *int64  `json:"int,omitempty"`
	Bool    *bool   `json:"bool,omitempty"`
	String  *string `json:"string,omitempty"`
	Version *string `json:"version,omitempty"`
}

type device struct {
	Driver     string            `json:"driver"`
	Multi      *bool             `json:"allowMultipleAllocations,omitempty"`
	Attributes map[string]attr   `json:"attributes"`
	Capacity   map[string]string `json:"capacity"`
}

type testCase struct {
	Expression string `json:"expression"`
	Device     string `json:"device"`
	// Raw evaluates the expression without a device and reports its value, whatever its type.
	Raw bool `json:"raw,omitempty"`
}

type input struct {
	Devices map[string]device `json:"devices"`
	Cases   []testCase        `json:"cases"`
}

type output struct {
	Expression   string `json:"expression"`
	Device       string `json:"device"`
	CompileError string `json:"compileError,omitempty"`
	Result       *bool  `json:"result,omitempty"`
	RuntimeError string `json:"runtimeError,omitempty"`
	MaxCost      uint64 `json:"maxCost"`
	Value        any    `json:"value,omitempty"`
	Type         string `json:"type,omitempty"`
}

func main() {
	var in input
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		panic(err)
	}
	compiler := dracel.GetCompiler(dracel.Features{EnableConsumableCapacity: true})
	var out []output
	for _, c := range in.Cases {
		o := output{Expression: c.Expression, Device: c.Device}
		result := compiler.CompileCELExpression(c.Expression, dracel.Options{})
		o.MaxCost = result.MaxCost
		if result.Error != nil {
			o.CompileError = result.Error.Error()
			out = append(out, o)
			continue
		}
		if c.Raw {
			val, _, err := result.Program.Eval(map[string]any{"device": map[string]any{}})
			if err != nil {
				o.RuntimeError = err.Error()
			} else {
				o.Type = val.Type().TypeName()
				o.Value = fmt.Sprintf("%#v", val.Value())
			}
			out = append(out, o)
			continue
		}
		d := in.Devices[c.Device]
		input := dracel.Device{Driver: d.Driver, AllowMultipleAllocations: d.Multi,
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{},
			Capacity:   map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{}}
		for name, a := range d.Attributes {
			input.Attributes[resourceapi.QualifiedName(name)] = resourceapi.DeviceAttribute{IntValue: a.Int, BoolValue: a.Bool, StringValue: a.String, VersionValue: a.Version}
		}
		for name, q := range d.Capacity {
			input.Capacity[resourceapi.QualifiedName(name)] = resourceapi.DeviceCapacity{Value: resource.MustParse(q)}
		}
		matches, _, err := result.DeviceMatches(context.Background(), input)
		if err != nil {
			o.RuntimeError = dracel.EnhanceRuntimeError(err).Error()
		} else {
			o.Result = &matches
		}
		out = append(out, o)
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(out); err != nil {
		panic(err)
	}
}
