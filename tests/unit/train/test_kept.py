"""train.kept.Kept: what a warm worker keeps is rebuilt whenever its key changes, and a plain job keeps nothing."""

from kdsweep.train.kept import Kept


def test_a_kept_thing_is_reused_for_the_same_key_and_rebuilt_for_another():
    kept, builds = Kept(), []

    def build(tag):
        return lambda: builds.append(tag) or object()

    kept.begin_run()
    first = kept.get("data", lambda: ("rows", 1), build("a"))
    assert kept.reused == [] and builds == ["a"]
    kept.begin_run()
    assert kept.get("data", lambda: ("rows", 1), build("b")) is first and kept.reused == ["data"] and builds == ["a"]
    kept.begin_run()
    other = kept.get("data", lambda: ("rows", 2), build("c"))  # another key: never the old object
    assert other is not first and builds == ["a", "c"] and kept.reused == []
    assert kept.get("teacher", lambda: 1, build("d")) is not other  # kinds are kept apart


def test_a_plain_jobs_kept_builds_every_time_and_never_computes_a_key():
    kept = Kept.one_run()

    def key():
        raise AssertionError("a plain job must not pay for a key (a teacher's key hashes its files)")

    a, b = kept.get("data", key, object), kept.get("data", key, object)
    assert a is not b and kept.reused == []
