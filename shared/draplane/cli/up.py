"""`draplane up`: the local environment in one command.

It supervises what it started: a service or server that dies is restarted with backoff, and `up`
says which died and how. Only Ctrl-C (or SIGTERM) stops everything; `up` exits 1 if it stopped
because a process died too often to be kept alive."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("up", help="start a local control plane, the services, simulated nodes and a real one")
    parser.add_argument("--nodes", type=int, default=4, help="simulated nodes, dealt over the shipped profiles (default 4)")
    parser.add_argument("--shards", type=int, default=2, help="allocator shards (default 2)")
    parser.add_argument("--workdir", type=Path, default=None, help="state and logs (default ~/.local/state/draplane/up)")
    real = parser.add_mutually_exclusive_group()
    real.add_argument("--real-node", dest="real_node", action="store_true", default=None,
                      help="require the real node (a real kubelet and containerd); fail if this machine cannot run it "
                      "(default: run it where the machine can, else say why and go on with the simulated nodes)")
    real.add_argument("--no-real-node", dest="real_node", action="store_false", help="run no real node")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.nodes < 1 or args.shards < 1:
        print("draplane up: --nodes and --shards must be at least 1", file=sys.stderr)
        return 2
    return asyncio.run(_up(args))


async def _up(args: argparse.Namespace) -> int:
    from draplane.localenv import binaries, environment
    from draplane.localenv.processes import StartupError

    try:
        env = await environment.start(
            node_count=args.nodes, shards=args.shards, workdir=args.workdir, real_node=args.real_node,
            progress=lambda message: print(f"draplane up: {message}", flush=True),
        )
    except (environment.AlreadyRunning, binaries.BinaryError, StartupError) as exc:
        from draplane.localenv.realnode import RealNodeError

        hint = "\n(`draplane up --no-real-node` runs the simulated nodes only)" if isinstance(exc, RealNodeError) else ""
        print(f"draplane up: {exc}{hint}", file=sys.stderr)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    kubectl = binaries.find(binaries.KUBECTL)
    # the commands below find this `up` through its workdir: one given here must be given to them
    at = f" --workdir {args.workdir}" if args.workdir is not None else ""
    kubectl_line = f"{kubectl or 'kubectl'} --kubeconfig {env.kubeconfig}"
    if env.real_node is not None:
        real = (f"  real node:  {env.real_node.name}: a real kubelet and containerd, whose pods run busybox containers "
                f"with the devices its DRA plugin prepared\n")
        run_one = (f"  run a pod:  {kubectl_line} apply -f {_example('two-gpus.yaml')}\n"
                   f"              then: {kubectl_line} logs two-gpus\n")
    else:
        real, run_one = f"  real node:  none ({env.real_node_absent})\n", ""
    print(
        f"\ndraplane is up: {sum(len(n) for n in env.nodes.values())} simulated nodes, {env.shards} allocator shards.\n"
        f"{real}"
        f"  kubeconfig: {env.kubeconfig}\n"
        f"  try:        {kubectl_line} get nodes,resourceslices,deviceclasses\n"
        f"{run_one}"
        f"  logs:       tail -f {env.logs}/*.log\n"
        f"  free:       draplane free{at}        (devices still free, by class and node; from NATS)\n"
        f"  audit:      draplane audit{at}       (every placement, release, rejection and taint)\n"
        f"  map:        draplane dashboard{at}   (the devices and pending pods, live: http://127.0.0.1:8090/)\n"
        f"  explain:    draplane explain --kubeconfig {env.kubeconfig} -n NAMESPACE POD   (why it is pending)\n"
        f"A service or server that dies is restarted (with backoff); Ctrl-C stops everything.",
        flush=True,
    )
    try:
        gave_up = await supervise(env.processes, stop)
    finally:
        print("draplane up: stopping", flush=True)
        await asyncio.to_thread(env.stop)
    return 1 if gave_up else 0


def _example(name: str) -> Path:
    return Path(__file__).resolve().parents[3] / "examples" / "real-node" / name


async def supervise(processes, stop: asyncio.Event, policy=None, poll: float = 0.5) -> bool:
    """Keep every process alive until `stop`: a dead one is restarted after a backoff, and said so.
    True when one died too often to be kept alive (then `up` stops and exits 1)."""
    from draplane.localenv.supervisor import GiveUp, RestartPolicy, Supervision, describe_exit

    policy = policy or RestartPolicy()
    supervision = {id(p): Supervision(policy) for p in processes}
    pending: dict[int, float] = {}  # id(process) -> when to start it again
    now = time.monotonic()
    for process in processes:
        supervision[id(process)].started(now)
    while not stop.is_set():
        now = time.monotonic()
        for process in processes:
            key = id(process)
            if key in pending:
                if now < pending[key]:
                    continue
                del pending[key]
                try:
                    process.start()
                except Exception as exc:  # noqa: BLE001 - a start that fails counts as one more crash
                    how = f"could not be started: {exc}"
                else:
                    supervision[key].started(now)
                    print(f"draplane up: {process.name} restarted (pid {process.pid}); log: {process.log_path}", flush=True)
                    continue
            elif process.alive():
                continue
            else:
                how = describe_exit(process.process.returncode if process.process else None)
            decision = supervision[key].exited(now)
            if isinstance(decision, GiveUp):
                print(f"draplane up: {process.name} died ({how}) {decision.crashes} times within "
                      f"{decision.window / 60:.0f} min: it cannot be kept alive, so everything stops. Its log "
                      f"({process.log_path}) ends:\n{process.log_tail()}", file=sys.stderr, flush=True)
                return True
            print(f"draplane up: {process.name} died ({how}); restarting it in {decision.delay:.0f} s "
                  f"(crash {decision.crashes} in {policy.window / 60:.0f} min). Its log ({process.log_path}) "
                  f"ends:\n{process.log_tail(8)}", file=sys.stderr, flush=True)
            pending[key] = decision.at
        try:
            await asyncio.wait_for(stop.wait(), poll)
        except asyncio.TimeoutError:
            pass
    return False
