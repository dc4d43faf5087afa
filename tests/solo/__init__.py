"""Tests that hold the live system's timing to modelled time (a mock fleet against the simulator,
the planner, KV routing's tail latency). They mostly wait on modelled time and need the cores
quiet, so `make test` runs this directory on its own after the rest, two tests at a time; the
root conftest marks them `solo`."""
