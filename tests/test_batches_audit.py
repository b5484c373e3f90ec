"""The trainer's lease (lib/train/batches.py): a batch whose every group the audit leaves out (a liar's batch) is
passed over, and its audit metrics are counted in the row of the step that trains the next batch. Before, they were
dropped: a local run whose first batch was 8 of a lying participant's groups, all failing the `reward` check (the
proxy counted 8 failures and quarantined it), logged `audit/failed` 0 in every step (bench/participants_run.py,
docs/results/trust.md#two-participants-on-environment-tasks)."""
import threading

from batches import Batches, merged


class Held:
    """TrainedGroups' part the lease uses: every group is new; what was acked is kept."""

    def __init__(self):
        self.acked = []

    def hold(self, got):
        return list(got["groups"]), []

    def trained_on(self, got):
        self.acked.append(got["batch_id"])


def test_a_batch_left_out_whole_is_counted_in_the_next_steps_audit_metrics():
    held = Held()
    b = Batches(client=None, owner=None, trained=held, stop=threading.Event(), batch_groups=2, wait_s=1, max_steps=3)
    batches = iter([{"batch_id": "liar", "groups": ["m1", "m2"]}, {"batch_id": "honest", "groups": ["g1", "g2"]}])
    b.ask = lambda step, after=None, waiting=None: next(batches)

    def audit(got):
        liar = got["batch_id"] == "liar"
        return ([] if liar else got["fresh"]), {
            "audit/groups": 2, "audit/failed": 2 if liar else 0, "audit/failed_reward": 2 if liar else 0,
            "audit/left_out": 2 if liar else 0, "audit/logprob_dev_max": 0.5 if liar else 1e-5,
            "perf/audit_s": 0.25, "groups/invalid": 0}

    got = b.lease(1, audit)
    assert got["batch_id"] == "honest" and got["fresh"] == ["g1", "g2"] and held.acked == ["liar"]
    assert got["audit"] == {"audit/groups": 4, "audit/failed": 2, "audit/failed_reward": 2, "audit/left_out": 2,
                            "audit/logprob_dev_max": 0.5, "perf/audit_s": 0.5, "groups/invalid": 0}


def test_merged_keeps_the_largest_deviation_and_adds_the_rest():
    assert merged({}, {"audit/failed": 1}) == {"audit/failed": 1}
    assert merged({"audit/logprob_dev_mean_max": 0.1, "audit/failed": 1},
                  {"audit/logprob_dev_mean_max": 0.01, "audit/failed": 0, "audit/groups": 3}) == \
        {"audit/logprob_dev_mean_max": 0.1, "audit/failed": 1, "audit/groups": 3}
