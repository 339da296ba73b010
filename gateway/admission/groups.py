"""Scenario groups (P/D-Serve section 3.2): which group serves a request, and its limits.

A request's group is, in order: the one its API key is bound to; the first configured rule
(`GatewaySettings.groups`) it matches (by model, API key name, ``x-pdgate-group`` header
value, prompt length); the group its header names directly; `default_group` (unset: any group
serving its model), unless `reject_unmatched`. Each group's instances are those registered
with that group; its TTFT deadline and queue bound come from its rule, else the defaults.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdgate.config.settings import GatewaySettings, ScenarioGroup
from pdgate.gateway.admission.auth import PRIORITIES, ApiKey
from pdgate.gateway.admission.retry_after import RetryAfter
from pdgate.gateway.errors import BadRequest, Forbidden, ModelNotFound, ServiceUnavailable
from pdgate.gateway.instances.tracker import InstanceTracker

__all__ = ["GROUP_HEADER", "GroupResolver"]

GROUP_HEADER = "x-pdgate-group"


class GroupResolver:
    def __init__(
        self, settings: GatewaySettings, tracker: InstanceTracker, retry_after: RetryAfter
    ) -> None:
        self._settings = settings
        # What every refusal of the gateway tells its client to wait (its endpoints' too).
        self.retry_after = retry_after
        self._tracker = tracker
        self._rules: Mapping[str, ScenarioGroup] = {g.name: g for g in settings.groups}

    def model(self, requested: str | None) -> str:
        """The model a request is for: the one it names (a model or an adapter ready
        instances serve), else the one model served. Raises 400 (none named, several
        served), 404 (nobody serves it) or 503 (no instance at all)."""
        if requested is None:
            model = self._tracker.default_model()
            if model is None:
                raise BadRequest(
                    "model is required when the gateway serves several models", param="model"
                )
            return model
        models = self._tracker.models()
        if requested not in models:
            if not models:
                raise ServiceUnavailable(
                    "no instances are registered", retry_after=self.retry_after.membership()
                )
            raise ModelNotFound(f"the model {requested!r} does not exist", param="model")
        return requested

    def resolve(
        self, model: str, key: ApiKey | None, header: str | None, prompt_chars: int
    ) -> str | None:
        """The request's group (None: any group of the model). Raises a 4xx/503 error."""
        if key is not None and key.group is not None:
            if header is not None and header != key.group:
                raise Forbidden(f"this API key may not use group {header!r}", param=GROUP_HEADER)
            return self._available(model, key.group)
        for rule in self._settings.groups:
            if rule.matches(model, key.name if key else None, header, prompt_chars):
                return self._available(model, rule.name)
        if header is not None:
            # A group the client names must exist, else every request to a typo would wait
            # out its deadline.
            if header not in self._tracker.groups(model):
                raise BadRequest(
                    f"no instance of model {model!r} is in group {header!r}", param=GROUP_HEADER
                )
            return header
        if self._settings.groups and self._settings.reject_unmatched:
            raise BadRequest("no scenario group accepts this request", param=GROUP_HEADER)
        if self._settings.default_group is not None:
            return self._available(model, self._settings.default_group)
        return None

    def _available(self, model: str, group: str) -> str:
        if group not in self._tracker.groups(model):
            raise ServiceUnavailable(
                f"no instance of model {model!r} serves group {group!r}",
                retry_after=self.retry_after.membership(),
            )
        return group

    def ttft_timeout_s(self, group: str | None) -> float:
        rule = self._rules.get(group or "")
        if rule is not None and rule.ttft_timeout_s is not None:
            return rule.ttft_timeout_s
        return self._settings.group_ttft_timeout_s.get(group or "", self._settings.ttft_timeout_s)

    def tpot_slo_s(self, group: str | None) -> float:
        rule = self._rules.get(group or "")
        if rule is not None and rule.tpot_slo_s is not None:
            return rule.tpot_slo_s
        return self._settings.group_tpot_slo_s.get(group or "", self._settings.tpot_slo_s)

    def queue_size(self, group: str | None) -> int:
        rule = self._rules.get(group or "")
        if rule is not None and rule.queue_size is not None:
            return rule.queue_size
        return self._settings.queue_size

    def priority(self, group: str | None) -> int | None:
        """The group's default priority class, if its rule sets one."""
        rule = self._rules.get(group or "")
        if rule is None or rule.priority is None:
            return None
        return PRIORITIES[rule.priority]
