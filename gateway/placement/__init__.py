"""Choosing a prefill and a decode for a request.

`dispatch.Dispatcher` is the entry; the composition root builds the parts it holds. A
request waits in its (model, group) queue (`queues`, `queue`), which its admission
(`admission`) takes, refuses or sheds it from at the pace the fleet drains it (`drain`);
that queue's forwarder (`forwarder`) takes slots through the fleet's leases (`leases`),
forms a run (`batching`) and its calls send it to a prefill and settle the answers
(`prefill_call`), timed by `prefill_time`; the parts every queue shares are in `shared`.
The prefilled request goes to a decode (`decode_leg`, each try a `decode_attempt`), or both
legs go to one instance: a decode whose own prefill is cheaper (`local_prefill`), an
aggregated or partial group's instance (`aggregated`, `partial`). `direct` is the paper's
baseline prefill leg. `placed.Placement` owns every count the request then holds.

May import: errors, observe, upstream, instances, admission."""
