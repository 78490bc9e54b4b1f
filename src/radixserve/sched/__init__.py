"""Requests, queue policies, admission and the Scheduler. Pure Python and numpy, no torch."""

from radixserve.sched.policy import make_schedule_policy, order_queue
from radixserve.sched.request import FinishReason, Req, ReqState, SamplingParams
from radixserve.sched.scheduler import (
    Batch,
    BatchEntry,
    ForwardMode,
    Scheduler,
    SchedulerConfig,
    SchedulerStats,
)

__all__ = [
    "Batch",
    "BatchEntry",
    "FinishReason",
    "ForwardMode",
    "Req",
    "ReqState",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "make_schedule_policy",
    "order_queue",
]
