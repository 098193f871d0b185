"""Every Redis key argus reads or writes, and the job list: one place for the layout.

Each of a job's keys carries the job as its Redis Cluster hash tag (``argus:{JOB}:...``), so one
job lives on one slot and nothing crosses slots (docs/schema.md, "Redis keys"); only the job set
``argus:jobs`` lives elsewhere. Agents and `argus replay` write steps, heartbeats, names and the
registry; the aggregator writes alerts, their state and its lease; everything else reads.
"""

from __future__ import annotations

from typing import Any, List

K_JOBS = "argus:jobs"  # set: job ids that have data


def k_steps(job: str) -> str:
    return f"argus:{{{job}}}:steps"  # stream of encoded RankSteps


def k_hb(job: str) -> str:
    return f"argus:{{{job}}}:hb"  # stream of encoded heartbeats


def k_agent(job: str, agent: str) -> str:
    return f"argus:{{{job}}}:agent:{agent}"  # string, TTL: the agent's latest heartbeat


def k_agents(job: str) -> str:
    return f"argus:{{{job}}}:agents"  # hash: agent -> registry record


def k_names(job: str) -> str:
    return f"argus:{{{job}}}:names"  # hash: interned kernel-name id -> name


def k_alerts(job: str) -> str:
    return f"argus:{{{job}}}:alerts"  # stream (and pub/sub channel) of alert transitions


def k_alert_state(job: str) -> str:
    return f"argus:{{{job}}}:alert_state"  # hash: alert id -> its latest JSON


def k_leader(job: str) -> str:
    return f"argus:{{{job}}}:leader"  # string with a TTL: the aggregator leading the job


# ---- one job over several aggregators (argus.aggregator.sharded) ---------------------------------------
# Under the job's hash tag like every other key of it: a job stays on one Redis Cluster slot.


def k_shard_plan(job: str) -> str:
    return f"argus:{{{job}}}:shardplan"  # string: the job's partition of ranks into shards (set once)


def k_shard_extra(job: str) -> str:
    return f"argus:{{{job}}}:shardextra"  # hash: rank -> shard, for ranks the plan did not know


def k_shard_steps(job: str, shard: int) -> str:
    return f"argus:{{{job}}}:shard:{shard}:steps"  # stream: the job's summaries of one shard's ranks


def k_shard_hb(job: str, shard: int) -> str:
    return f"argus:{{{job}}}:shard:{shard}:hb"  # stream: heartbeats of agents with ranks in the shard


def k_shard_owner(job: str, shard: int) -> str:
    return f"argus:{{{job}}}:shard:{shard}:owner"  # string with a TTL: the member judging the shard


def k_reduce(job: str) -> str:
    return f"argus:{{{job}}}:reduce"  # stream: per-step partials of the shards, for the reducer


def k_reducer(job: str) -> str:
    return f"argus:{{{job}}}:reducer"  # string with a TTL: the member reducing the job


def list_jobs(client: Any) -> List[str]:
    """The job ids in Redis, sorted."""
    return sorted(
        x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in client.smembers(K_JOBS)
    )
