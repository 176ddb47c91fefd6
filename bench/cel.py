"""CEL selector evaluation: µs per evaluation over 10,000 distinct devices.

    .venv/bin/python bench/cel.py [--devices N] [--alternatives]

`cel_eval_10000` is draplane.cel (cel-expr-python, the C++ runtime, behind the module's
Kubernetes checks) on an attribute selector; `cel_first_eval_10000` is the first selector on each
device, which also builds the device's runtime activation; `cel_eval_quantity_10000` adds the
quantity library (two Python callbacks per evaluation); `device_for_cel_10000` is building the CEL
view of a device; `cel_compile` is one compile_selector() without the cache (parse, check, cost,
rewrite). All figures are CPU time per call (time.process_time), steadier than wall time on a
shared machine.
With --alternatives it also times the other installed engines on the attribute selector, without
Kubernetes' types or libraries (they have no type checker for them): common-expression-language
(Rust interpreter) and cel-python (pure Python).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from draplane.api.resource import Device, DeviceAttribute, DeviceCapacity
from draplane.cel import compile_selector, device_for_cel

DRIVER = "gpu.nvidia.com"
ATTRIBUTE_SELECTOR = 'device.attributes["gpu.nvidia.com"].productName == "NVIDIA A100-SXM4-80GB"'
QUANTITY_SELECTOR = 'device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("40Gi"))'


def slice_devices(count: int) -> list[Device]:
    products = ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA L4"]
    return [
        Device(
            name=f"gpu-{i}",
            attributes={
                "type": DeviceAttribute(string_value="gpu"),
                "index": DeviceAttribute(int_value=i % 8),
                "productName": DeviceAttribute(string_value=products[i % 3]),
                "driverVersion": DeviceAttribute(version_value=f"550.{i % 100}.0"),
                "resource.kubernetes.io/pcieRoot": DeviceAttribute(string_value=f"pci{i // 4}"),
            },
            capacity={"memory": DeviceCapacity(value=f"{(i % 3 + 1) * 24}Gi")},
        )
        for i in range(count)
    ]


def per_eval_us(fn, items) -> float:
    """CPU µs per call: on a shared machine, wall time measures the neighbours too."""
    start = time.process_time()
    for item in items:
        fn(item)
    return (time.process_time() - start) / len(items) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--alternatives", action="store_true")
    args = parser.parse_args()
    n = args.devices
    devices = slice_devices(n)

    build_us = per_eval_us(lambda d: device_for_cel(DRIVER, d), devices)
    cel_devices = [device_for_cel(DRIVER, d) for d in devices]
    attribute = compile_selector(ATTRIBUTE_SELECTOR)
    quantity = compile_selector(QUANTITY_SELECTOR)
    # The first selector evaluated on a device also builds the device's runtime view (once per
    # device, shared by all selectors); the allocator pays that once per device too.
    first_us = per_eval_us(attribute.matches, cel_devices)
    attribute_us = per_eval_us(attribute.matches, cel_devices)
    quantity_us = per_eval_us(quantity.matches, cel_devices)
    start = time.process_time()
    for _ in range(200):
        compile_selector.cache_clear()
        compile_selector(QUANTITY_SELECTOR)
    compile_us = (time.process_time() - start) / 200 * 1e6

    print(f"BENCH name=device_for_cel_{n} us_per_device={build_us:.2f}")
    print(f"BENCH name=cel_compile us_per_compile={compile_us:.1f}")
    print(f"BENCH name=cel_first_eval_{n} us_per_eval={first_us:.2f} engine=cel-expr-python")
    print(f"BENCH name=cel_eval_{n} us_per_eval={attribute_us:.2f} engine=cel-expr-python")
    print(f"BENCH name=cel_eval_quantity_{n} us_per_eval={quantity_us:.2f} engine=cel-expr-python")

    if args.alternatives:
        # Plain JSON-like values only: these engines know nothing of Quantity or Semver.
        activations = [
            {
                "device": {
                    "driver": d.driver,
                    "attributes": {dom: {k: v for k, v in ids.items() if not isinstance(v, bytes)} for dom, ids in d.cel_value()["attributes"].items()},
                }
            }
            for d in cel_devices
        ]
        # This script is itself named cel.py: keep its folder off the path so that `import cel`
        # finds the common-expression-language package.
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
        sys.modules.pop("cel", None)
        try:
            import cel as rust_cel

            program = rust_cel.compile(ATTRIBUTE_SELECTOR)
            us = per_eval_us(program.execute, activations)
            print(f"BENCH name=cel_eval_{n}_common_expression_language us_per_eval={us:.2f}")
        except ImportError:
            pass
        try:
            import celpy

            env = celpy.Environment()
            program = env.program(env.compile(ATTRIBUTE_SELECTOR))
            converted = [{"device": celpy.json_to_cel(a["device"])} for a in activations[:1000]]
            us = per_eval_us(program.evaluate, converted)
            print(f"BENCH name=cel_eval_1000_cel_python us_per_eval={us:.2f}")
        except ImportError:
            pass


if __name__ == "__main__":
    main()
