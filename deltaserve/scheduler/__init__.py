"""Pure-Python scheduling: requests, step plans, checkpoint policies, the scheduler and its background jobs (no
torch)."""
from .plan import SeqWork, StateCopy, StepPlan
from .policy import AlignEveryBlock, CheckpointPolicy, GridChunks, NoCheckpoints
from .request import Request, RequestStatus
from .scheduler import Scheduler
from .stats import SchedulerStats

__all__ = ["AlignEveryBlock", "CheckpointPolicy", "GridChunks", "NoCheckpoints", "Request", "RequestStatus", "Scheduler",
           "SchedulerStats", "SeqWork", "StateCopy", "StepPlan"]
