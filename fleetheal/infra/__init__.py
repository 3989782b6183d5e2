"""fleetheal's infrastructure code: Pulumi components, stack config, the CrossGuard validators and
`fleetheal render`. The Pulumi program (`pulumi/__main__.py`) and the policy pack (`policies/`) only
wire these together."""
