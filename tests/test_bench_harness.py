"""The benches' shared harness (bench/harness.py): interleaving and paired statistics, and its free port."""

from __future__ import annotations

import socket

import pytest

from bench.harness import free_port, pair_roles, paired_overheads, pct, quantile, rotated


def test_every_item_leads_once_and_the_order_of_a_pair_alternates() -> None:
    items = ["a", "b", "c"]
    assert [rotated(items, pair)[0] for pair in range(3)] == ["a", "b", "c"]
    assert all(sorted(rotated(items, pair)) == items for pair in range(5))
    assert [pair_roles(pair, 0) for pair in range(2)] == [("base", "tool"), ("tool", "base")]
    assert pair_roles(0, 1) == ("tool", "base")  # the next tool in the same pair starts the other way


def test_paired_overheads_compare_each_round_with_its_partner() -> None:
    s = paired_overheads(base=[10.0, 20.0, 40.0], tool=[11.0, 20.0, 44.0])
    assert s["overhead"] == pytest.approx(0.1) and s["min"] == pytest.approx(0.0) and s["max"] == pytest.approx(0.1)
    assert s["pairs"] == 3 and pct(s["overhead"]) == "+10.0%"
    with pytest.raises(ValueError):
        paired_overheads([1.0], [1.0, 2.0])  # an unpaired round is a bug in the schedule
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.25) == pytest.approx(2.0)


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
