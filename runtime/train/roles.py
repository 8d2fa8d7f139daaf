"""Model roles: the models a job runs beside the policy, each named by what it is for and what it writes.

The loop asks for models by role (:func:`roles_for` of the job's config), never with flags like ``need_ref``. A role
says whether its weights train and which batch-contract key its forward pass fills on a rollout batch; a backend
builds one model per role it is given and refuses the roles it cannot run, naming them. Both backends run the
actor, the reference, the on-policy-distillation teacher and the critic (a value-head copy of the model, trained
with its own optimizer) in the same processes, as slime keeps its reference in the actor's and places its critic on
the actor's GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlcore import keys


@dataclass(frozen=True)
class ModelRole:
    """One model of the job: ``name``, whether it trains, and the key of the rollout batch its forward pass writes."""

    name: str
    trainable: bool
    writes: str


ACTOR = ModelRole("actor", trainable=True, writes=keys.OLD_LOG_PROBS)
REFERENCE = ModelRole("reference", trainable=False, writes=keys.REF_LOG_PROBS)
CRITIC = ModelRole("critic", trainable=True, writes=keys.VALUES)
TEACHER = ModelRole("teacher", trainable=False, writes=keys.TEACHER_LOG_PROBS)
ROLES = {role.name: role for role in (ACTOR, REFERENCE, CRITIC, TEACHER)}


def roles_for(*, use_kl_loss: bool, kl_coef: float, estimator: str) -> tuple[ModelRole, ...]:
    """The roles a job needs: always the actor; the reference for a KL loss or a KL-in-reward penalty; the critic
    for GAE (slime's ``ppo``); the teacher for on-policy distillation (``estimator`` is rlcore's name)."""
    roles = [ACTOR]
    if use_kl_loss or kl_coef > 0:
        roles.append(REFERENCE)
    if estimator == "gae":
        roles.append(CRITIC)
    if estimator == "distillation":
        roles.append(TEACHER)
    return tuple(roles)
