//! The conformance suite: the store's behaviour, written once and run
//! against every backend (LangGraph keeps one for its checkpointers; so do
//! we). keel-store runs it on SQLite (`tests/it/main.rs`),
//! keel-store-postgres on a real PostgreSQL server; a third backend runs it
//! with one line: `keel_store::conformance_suite!(crate::my_harness);`,
//! where `my_harness` is an `async fn() -> Option<impl Harness>` (`None`:
//! this backend cannot run here, and every test says it was skipped).
//!
//! Compiled only with the `conformance` feature (tests enable it).
//!
//! # Adding a test
//! Write `pub async fn the_behaviour_in_words(db: TestDb)` in the module of
//! its area (a fresh, empty, migrated database; `db.store` is a store on
//! it, `db.reopen()` another one, as a new process would open it), and add
//! its name to that module's list in [`conformance_suite!`]. Use only the
//! [`crate::Backend`] API: a test that needs the SQLite file itself (a
//! path, a PRAGMA, raw SQL) stays in keel-store's `tests/it/`.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

pub mod approvals;
pub mod check;
pub mod checkpoints;
pub mod fixtures;
pub mod images;
pub mod inbox;
pub mod mcp;
pub mod messages;
pub mod observe;
pub mod projection;
pub mod purge;
pub mod runs;
pub mod runtime;
pub mod sessions;
pub mod spend;
pub mod timelines;
pub mod tree;
pub mod webhooks;

use std::any::Any;
use std::future::Future;
use std::pin::Pin;

use crate::Store;

/// A backend under test: makes fresh databases.
#[async_trait::async_trait]
pub trait Harness: Send + Sync + 'static {
    /// A fresh, empty database of this backend, migrated, with a store on it.
    async fn create(&self) -> TestDb;
}

/// How a [`TestDb`] opens another store on its database.
pub type Reopen = Box<dyn Fn() -> Pin<Box<dyn Future<Output = Store> + Send>> + Send + Sync>;

/// How a [`TestDb`] answers a query of one integer behind the store's back.
pub type Scalar = Box<dyn Fn(String) -> Pin<Box<dyn Future<Output = i64> + Send>> + Send + Sync>;

/// One test's database: a store on it, and what keeps it alive.
pub struct TestDb {
    /// A store on the database.
    pub store: Store,
    reopen: Reopen,
    scalar: Scalar,
    _keep: Box<dyn Any + Send + Sync>,
}

impl TestDb {
    /// A database reached through `store`; `reopen` opens another store on
    /// it; `scalar` runs a read-only query of one integer on it (for tests
    /// that count rows); `keep` (a temporary directory, a test database)
    /// lives as long.
    pub fn new(store: Store, reopen: Reopen, scalar: Scalar, keep: impl Any + Send + Sync) -> Self {
        Self {
            store,
            reopen,
            scalar,
            _keep: Box::new(keep),
        }
    }

    /// Another store on the same database, as a new process would open it.
    pub async fn reopen(&self) -> Store {
        (self.reopen)().await
    }

    /// The integer `sql` (one row, one column; SQL both backends read the
    /// same, such as `SELECT count(*) FROM checkpoints`) yields, read
    /// behind the store's back: what a test inspects without an API for it.
    pub async fn scalar(&self, sql: &str) -> i64 {
        (self.scalar)(sql.to_owned()).await
    }
}

/// Runs one test body on a fresh database of the harness, or says it was
/// skipped when the backend cannot run here.
#[doc(hidden)]
pub async fn run<H, F, Fut>(harness: Option<H>, name: &str, body: F)
where
    H: Harness,
    F: FnOnce(TestDb) -> Fut,
    Fut: Future<Output = ()>,
{
    match harness {
        Some(h) => body(h.create().await).await,
        None => eprintln!("{name}: skipped (this backend is not available here)"),
    }
}

/// Expands to the whole conformance suite as `#[tokio::test]`s, one module
/// per area, on the harness `$harness` (a path to an `async fn() ->
/// Option<impl Harness>`).
#[macro_export]
macro_rules! conformance_suite {
    ($harness:path) => {
        $crate::conformance_tests! { $harness;
            checkpoints {
                rollback_and_fork_are_copy_on_write_and_keep_old_branches,
                a_fork_and_a_rollback_count_the_inputs_of_the_history_they_show,
                unchanged_state_writes_no_blob,
                prune_keeps_what_heads_and_remaining_checkpoints_need,
                retention_finds_the_sessions_over_the_limit_and_prunes_past_one_batch,
                checkpoint_pages_go_newest_first_by_time_then_id_and_give_each_once,
            }
            inbox {
                signals_are_deduplicated_capacity_checked_and_need_a_live_execution,
                signal_limits_are_a_window_a_refilling_burst_and_a_cap,
                session_events_page_newest_first_and_new_ones_come_before_the_first_page,
                claim_then_continuation_consumes_events_with_the_turn,
                release_backs_off_and_dead_letters_after_max_attempts,
                one_turn_consumes_the_events_of_several_leases_of_its_own_session_only,
                a_release_that_is_no_failed_delivery_keeps_attempts_and_backoff,
                an_event_backing_off_past_its_time_to_live_is_due_for_dead_lettering,
                a_dead_letter_is_told_once_by_a_notice_in_the_sessions_history,
                racing_claimers_lease_every_event_to_exactly_one_of_them,
            }
            projection {
                message_pages_walk_the_current_branch_both_ways,
                runs_filter_and_changes_come_after_a_revision,
                checkpoint_and_run_event_pages_give_every_item_once,
            }
            purge {
                a_purge_removes_the_expired_deleted_dialogs_and_every_row_of_theirs,
                a_dialog_forked_from_keeps_the_shared_history_until_the_fork_is_purged,
                dialog_usage_counts_its_own_rows_and_checkpoints,
                deleted_dialogs_are_listed_newest_created_first_then_last_written_first,
            }
            timelines {
                every_session_and_checkpoint_loads_the_models_history,
            }
            tree {
                a_dialogs_tree_holds_every_branch_and_imports_as_a_dialog_that_reads_the_same,
                a_forks_tree_starts_with_the_history_it_inherited,
                an_import_that_does_not_fit_together_is_refused_whole,
            }
            sessions {
                create_get_rename_touch_and_soft_delete,
                empty_keys_are_rejected_before_sql,
                latest_active_dialog_and_session_tree,
                pagination_is_stable_under_inserts,
                import_session_creates_the_session_with_its_history_in_one_step,
                a_failed_import_leaves_no_session_behind,
            }
            messages {
                commit_turn_assigns_seqs_and_counts_visible_inputs,
                replay_sees_hidden_messages_clients_do_not,
                history_after_a_known_head_reads_only_what_follows_it_on_that_timeline,
                a_chats_dialogs_are_read_with_what_each_gained_since_a_known_head,
                a_turn_input_commits_first_and_its_answer_closes_it,
                unanswered_inputs_stay_and_are_never_answered_later,
                an_input_commit_checks_the_head_it_started_from,
                rollback_and_fork_never_show_a_half_turn,
                a_queued_input_enters_the_history_when_its_turn_opens_and_only_then,
                concurrent_appends_get_consecutive_seqs_per_session,
            }
            images {
                an_image_round_trips_by_hash_and_unknown_bytes_are_refused,
            }
            mcp {
                a_manifest_is_replaced_only_when_its_hash_changes_and_survives_a_reopen,
                a_manifest_that_is_not_json_or_has_a_bad_hash_is_refused,
            }
            spend {
                dialog_spend_adds_up_and_survives_reopening,
                a_budget_exhausted_run_records_what_it_spent,
            }
            runs {
                usage_above_i64_saturates,
                background_run_lifecycle_reserves_then_delivers_one_completion,
                execution_id_mismatch_updates_zero_rows,
                two_acceptances_for_the_last_slot_exactly_one_wins,
                idempotency_key_returns_the_existing_run_and_group,
                group_all_yields_one_group_completion_after_the_last_run,
                cancel_session_cancels_runs_releases_slots_and_dead_letters_events,
                run_listing_paginates_newest_first_and_finds_children,
            }
            runtime {
                activation_bumps_past_stamped_runs_and_recovers_them_in_one_step,
                a_superseded_generation_writes_nothing,
                a_turn_commit_refuses_a_history_that_moved,
                activation_releases_the_leases_of_the_process_before_it,
                activation_closes_the_inputs_a_dead_process_left_open,
            }
            observe {
                a_run_tree_holds_the_run_and_its_descendants_and_a_turn_every_run_it_started,
                the_inbox_gauges_count_waiting_and_dead_lettered_events,
                a_turns_calls_are_committed_with_it_in_order_and_capped,
                a_runs_calls_are_stored_by_the_winning_terminal_commit_only,
            }
            approvals {
                a_paused_turn_commits_its_history_with_one_pending_row_per_gated_call,
                a_decision_commits_once_and_approve_always_grants_the_tool,
                racing_decisions_commit_exactly_one,
                an_approval_past_its_expiry_is_recorded_expired_once,
                an_approved_call_starts_once_and_its_result_settles_the_rows,
                new_input_supersedes_pending_approvals_and_only_those,
                a_deleted_dialogs_approvals_wait_for_nothing,
                a_run_waiting_for_approval_is_resumable_once_its_approvals_are_decided,
            }
            webhooks {
                the_commit_answering_a_subscribed_input_creates_its_delivery,
                server_wide_urls_get_every_answering_commit_and_a_withdrawn_input_none,
                attempts_retry_then_deliver_or_dead_letter_after_the_last,
                a_pending_delivery_survives_reopening_the_database,
                a_background_run_of_a_hooked_turn_notifies_the_same_url_when_it_ends,
                server_wide_urls_get_every_background_runs_end_completed_or_cancelled,
                a_turn_that_fails_or_a_crash_cuts_off_is_delivered_as_unanswered,
            }
            check {
                what_the_commit_paths_write_is_clean_and_abandoned_runs_are_recovery_work,
                a_message_count_is_recounted_only_where_it_drifted,
                a_decoder_that_rejects_a_state_is_a_checkpoint_finding,
                an_image_reference_without_its_image_is_reported,
                a_turn_paused_for_approval_is_waiting_not_half_done,
            }
        }
    };
}

/// The expansion of [`conformance_suite!`].
#[doc(hidden)]
#[macro_export]
macro_rules! conformance_tests {
    ($harness:path; $($module:ident { $($test:ident),* $(,)? })*) => {
        $(
            mod $module {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $test() {
                        $crate::conformance::run(
                            $harness().await,
                            concat!(stringify!($module), "::", stringify!($test)),
                            $crate::conformance::$module::$test,
                        )
                        .await;
                    }
                )*
            }
        )*
    };
}
