from draplane.simulation.trace import TracePod
from draplane.simulation.workload import AllocationCurve, arrival_sequence

PODS = [TracePod(f"p{i:02d}", 1000, 1024, 1, m) for i, m in enumerate([1000, 500, 250, 1000, 100])] + [
    TracePod("cpu", 1000, 1024, 0, 0)
]


def test_inflated_to_target_without_overshooting():
    capacity = 3000
    arrivals = arrival_sequence(PODS, capacity, seed=3, inflate=1.3)
    demand = sum(p.gpu_demand_milli for p in arrivals)
    assert demand <= 1.3 * capacity
    # Copies stop at the first random pick that would overshoot, so at most one largest pod short.
    assert demand > 1.3 * capacity - max(p.gpu_demand_milli for p in PODS)
    assert len(arrivals) > len(PODS)
    assert len({p.name for p in arrivals}) == len(arrivals)  # copies get their own names
    assert arrival_sequence(PODS, capacity, seed=3, inflate=1.3) == arrivals
    assert [p.name for p in arrival_sequence(PODS, capacity, seed=4, inflate=1.3)] != [p.name for p in arrivals]


def test_trimmed_when_demand_is_above_target():
    arrivals = arrival_sequence(PODS, 1000, seed=1, inflate=1.3)
    assert sum(p.gpu_demand_milli for p in arrivals) <= 1300
    assert {p.name for p in arrivals} <= {p.name for p in PODS}


def test_curve_is_mean_per_percent():
    curve = AllocationCurve.empty(1000)
    curve.record(5, 5)  # 0%
    curve.record(12, 10)  # 1%
    curve.record(18, 12)  # 1%
    assert curve.points() == [(0, 0.5), (1, 1.1)]
    assert curve.final_allocated_pct() == 1.1
