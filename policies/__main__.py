"""fleetheal's CrossGuard policy pack: only assembles the rules from fleetheal.infra.policy.

Constructing PolicyPack starts the analyzer server and blocks, so nothing imports this module;
tests call the validators in fleetheal.infra.policy directly.
"""

from pulumi_policy import EnforcementLevel, PolicyPack

from fleetheal.infra import policy

PolicyPack(
    name="fleetheal",
    enforcement_level=EnforcementLevel.MANDATORY,
    policies=policy.policies(),
)
