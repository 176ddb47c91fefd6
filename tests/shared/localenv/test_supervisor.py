"""`draplane up`'s restart policy, stepped through crashes with a clock of the test's own."""

from draplane.localenv.supervisor import GiveUp, Restart, RestartPolicy, Supervision, describe_exit


def test_backoff_doubles_to_the_cap_and_gives_up_past_the_crash_limit():
    policy = RestartPolicy(initial_delay=1, max_delay=4, max_crashes=4, window=100, stable_after=60)
    s = Supervision(policy)
    s.started(0)
    delays = []
    now = 1.0
    for _ in range(4):
        decision = s.exited(now)
        assert isinstance(decision, Restart)
        delays.append(decision.delay)
        now = decision.at
        s.started(now)
        now += 1
    assert delays == [1, 2, 4, 4]
    assert isinstance(s.exited(now), GiveUp)


def test_a_process_that_ran_well_starts_the_backoff_afresh_and_old_crashes_age_out():
    policy = RestartPolicy(initial_delay=1, max_delay=30, max_crashes=2, window=100, stable_after=60)
    s = Supervision(policy)
    s.started(0)
    assert s.exited(1).delay == 1
    s.started(2)
    assert s.exited(3).delay == 2
    s.started(5)
    # ran 200 s: stable, and its two crashes are out of the window
    decision = s.exited(205)
    assert isinstance(decision, Restart) and decision.delay == 1 and decision.crashes == 1


def test_exits_are_said_as_a_person_says_them():
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-15) == "killed by SIGTERM"
