"""The endpoint picker (`sluicegate epp`): the routing core behind a gateway, over Envoy's ext_proc."""
