"""The endpoint picker (`sluicegate epp`): the routing core behind a gateway's ext_proc filter."""
