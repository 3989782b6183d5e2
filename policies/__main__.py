"""fleetheal's CrossGuard policy pack: only assembles the rules of the rules/ package (beside this file).

The pack stands alone: it needs its requirements.txt, never the fleetheal package. Constructing
PolicyPack starts the analyzer server and blocks, so nothing imports this module; tests call the
validators in rules/ (as fleetheal.infra.policy) directly.
"""

import rules
from pulumi_policy import EnforcementLevel, PolicyPack

PolicyPack(
    name="fleetheal",
    enforcement_level=EnforcementLevel.MANDATORY,
    policies=rules.policies(),
)
