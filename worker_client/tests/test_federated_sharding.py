import pytest

from muninn_worker.federated.sharding import Shard, plan_shards


def test_one_device_gets_the_whole_round():
    assert plan_shards(1000, [123.0]) == [Shard(0, 0, 1000)]


def test_no_device_known_still_makes_one_shard_for_anyone():
    assert plan_shards(10, []) == [Shard(None, 0, 10)]


def test_shard_sizes_follow_throughput_and_cover_every_sample():
    assert plan_shards(100, [1.0, 3.0]) == [Shard(0, 0, 25), Shard(1, 25, 100)]


def test_rounding_keeps_the_total_exact():
    shards = plan_shards(10, [1.0, 1.0, 1.0])
    sizes = [s.stop - s.start for s in shards]
    assert sum(sizes) == 10 and sorted(sizes) == [3, 3, 4]
    assert [s.device for s in shards] == [0, 1, 2]
    assert shards[0].start == 0 and shards[-1].stop == 10
    assert all(shards[i].stop == shards[i + 1].start for i in range(len(shards) - 1))


def test_devices_too_slow_for_a_minimum_shard_sit_the_round_out():
    assert plan_shards(100, [1.0, 100.0], min_shard=10) == [Shard(1, 0, 100)]


def test_unmeasured_devices_count_as_equals():
    assert plan_shards(4, [0.0, 0.0]) == [Shard(0, 0, 2), Shard(1, 2, 4)]


def test_empty_data_set_is_an_error():
    with pytest.raises(ValueError):
        plan_shards(0, [1.0])
