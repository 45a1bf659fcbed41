"""Pure-Python scheduling: requests, step plans, checkpoint policies and the scheduler (no torch)."""
from .plan import SeqWork, StateCopy, StepPlan
from .policy import AlignEveryBlock, CheckpointPolicy, GridChunks, NoCheckpoints
from .request import Request, RequestStatus
from .scheduler import Scheduler

__all__ = ["AlignEveryBlock", "CheckpointPolicy", "GridChunks", "NoCheckpoints", "Request", "RequestStatus", "Scheduler",
           "SeqWork", "StateCopy", "StepPlan"]
