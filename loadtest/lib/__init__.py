"""What every benchmark suite shares: one child-process handle (children), one SSE client
(sse), request statistics (stats), probes of the servers under test (probes), /proc readings
(procfs), a private Redis (redis), a cluster deployed as separate processes (deployed),
vllm-router as a comparison point (router), RSS sampling (rss) and generated doc blocks
(docs)."""
