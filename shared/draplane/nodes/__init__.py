"""A node's devices, pure: the hardware models a node agent reports (hardware), the node profiles
it can play and that `draplane up`, the benches and `draplane simulate --mig` deal out (profile,
with the YAML in profiles/), and how the inventory turns a node's devices into ResourceSlices
(slices). The node agent and the inventory service are their shells; the simulation uses them
without either service.
"""
