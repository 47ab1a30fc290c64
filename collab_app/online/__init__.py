"""The online loop: how one rating becomes one gradient, and the gradient a served adapter.

    person rates candidate k  (web/core.py store_feedback; rater = the server's
        │                      session id or HF login; only the session that generated the group)
        ▼
    store.add_ratings          one row per rater and joint sample, re-rating replaces it (kind:
                               stars / rank / pick_best, mapped to 1-5)
        │                      (store.py; returns.py holds the mapping)
        ▼
    returns.group_state        the group is "ready" once every joint answer has a return under
        │                      the ReturnRule (weighted, the default: 0.5 x rating + 0.5 x the
        │                      task's automatic reward; the automatic reward alone after human_timeout_s)
        ▼
    service.poll_once          ready_groups (a person's own coding problems held back unless an
        │                      admin allows them), a step when K are ready or the oldest waited T
        ▼
    MAGRPOTrainer.update       advantage = return − group mean, per agent; loss under the clipped
        │                      ratio (on-policy samples: the trainer's own log-probs, ratio 1; late
        │                      ones: the engine's stored behaviour log-probs); one AdamW step per
        │                      agent; the next adapter version written to a temp dir, renamed
        ▼
    store.record_adapter_version, then record_train_step: the groups that went into the gradient
        │                      are marked trained (too-late ones expired), in one transaction
        ▼
    hotswap.AdapterWatcher     sees the new version row, engine.load_adapter (vLLM on CPU: the version's
                               LoRA matrices loaded into the running engine) -> the next round uses it

`cpushare.py` keeps the serving engine and the trainer child on separate cores so that both
sides of this loop keep moving on a 2-core machine; `export.py` writes everything out.
"""
