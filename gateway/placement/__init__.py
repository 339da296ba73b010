"""Choosing a prefill and a decode for a request.

`dispatch.Dispatcher` is the entry: a request waits in its (model, group) queue (`queue`);
that queue's forwarder (`forwarder`) takes slots through the fleet's leases (`leases`),
forms a run (`batching`) and sends it to a prefill, timed by `prefill_time`; the prefilled
request goes to a decode (`decode_attempt`), or both legs go to one instance when its own
prefill is cheaper (`local_prefill`). `placed.Placement` owns every count the request then
holds.

May import: errors, observe, upstream, instances, admission."""
