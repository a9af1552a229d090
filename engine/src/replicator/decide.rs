//! The start and salvage decision, as a pure function of what the replicas reported.
//!
//! [`decide_start`] takes each replica's answer to Info at engine start (or why there was
//! none) and the operator's choices (a given volume uuid, `--salvage`), and returns which
//! replicas the engine serves from, which it hands back for a rebuild, which it leaves alone,
//! the generation it presents, and why ([`Reason`]); or the refusal ([`StartError`]). No I/O
//! happens here, so every case is in the table test below; `start.rs` gathers the reports,
//! calls this, and carries the decision out (fencing, snapshot chains, reconcile).
//!
//! The rules (DESIGN.md §3):
//!
//! 1. Identity: the volume's uuid is the one given, else the one the reachable replicas
//!    record (they must agree, or the start is refused), else a new one. A replica recording
//!    another uuid is foreign: reported, never current, never rebuilt.
//! 2. A replica that is unreachable or has another size is not current; it is handed back for
//!    a rebuild.
//! 3. Currency: if no replica records an epoch, no engine ever served them and all are
//!    current. Otherwise take the highest epoch any of them records and the members the
//!    replicas at that epoch name: the current replicas are the members reachable at that
//!    epoch, and they are provably current only when every member is among them. If one is
//!    missing the start is refused, unless a salvage was asked for: then it proceeds with the
//!    members it has, and says so.
//! 4. No current replica at all (every reachable one is stale) is refused even with salvage:
//!    there is nothing to serve from.
//! 5. The generation is one above the highest any current replica accepted.
//!
//! [`reconcile_plan`] is the same kind of function for step 3 of `start.rs`: from the flush
//! numbers the current replicas report once fenced, the flush since which they may differ
//! and the order in which they are preferred as the source of a block.

use std::collections::BTreeSet;
use std::fmt;

use zebu_proto::ids::ReplicaId;
use zebu_proto::numbers::{Epoch, FlushNumber, Generation};

use super::StartError;

/// What one replica answered at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    /// No Info from it: why (connect failed, no answer, closed).
    Unreachable(String),
    /// Its Info.
    Open(Reported),
}

/// The parts of a replica's Info the decision depends on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reported {
    pub id: ReplicaId,
    /// The uuid of the volume it records; empty when it records none (a replica made before
    /// identity existed, or never claimed).
    pub volume_uuid: String,
    pub size: u64,
    pub epoch: Epoch,
    /// The members of `epoch` it records.
    pub members: Vec<ReplicaId>,
    pub generation: Generation,
}

/// What the decision is made from.
#[derive(Debug, Clone)]
pub struct StartInput<'a> {
    pub volume: &'a str,
    /// `--volume-uuid` (or the manager's): overrides what the replicas record.
    pub given_uuid: Option<&'a str>,
    pub size: u64,
    pub salvage: bool,
    /// Each replica's address and report, in the order given.
    pub replicas: &'a [(String, Report)],
}

/// Where the volume's uuid comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UuidChoice {
    Given(String),
    /// The one every reachable replica that records a uuid records.
    Recorded(String),
    /// No replica records one and none was given: the caller makes one.
    New,
}

/// Why the engine may serve from the current replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reason {
    /// No replica records an epoch: no engine ever served them, so all are equally current.
    FirstStart,
    /// Every member of the highest epoch is reachable at that epoch.
    AllMembers { epoch: Epoch },
    /// Salvage was asked for and some members of `epoch` are missing: proceeding with
    /// `present` of `members` without proof that they hold every acknowledged write.
    Salvage {
        epoch: Epoch,
        present: usize,
        members: usize,
        details: String,
    },
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::FirstStart => f.write_str("no replica records an epoch: first start"),
            Reason::AllMembers { epoch } => {
                write!(f, "every member of epoch {} is reachable", epoch.0)
            }
            Reason::Salvage {
                epoch,
                present,
                members,
                details,
            } => write!(
                f,
                "SALVAGE requested: serving from {present} of {members} members of epoch {} \
                 ({details})",
                epoch.0
            ),
        }
    }
}

/// The decision: indices into [`StartInput::replicas`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub uuid: UuidChoice,
    /// Serve from these (before their snapshot chains are compared).
    pub current: Vec<usize>,
    /// Reachable replicas of this volume that are not current: the caller rebuilds them.
    pub stale: Vec<usize>,
    /// Unreachable, or of another size: handed back for a rebuild too.
    pub absent: Vec<usize>,
    /// Replicas of another volume: left alone.
    pub foreign: Vec<usize>,
    /// The highest epoch any reachable replica records (0: none).
    pub epoch: Epoch,
    /// The generation to present: one above the highest a current replica accepted.
    pub generation: Generation,
    pub reason: Reason,
}

/// Decides which replicas an engine starts from; see the module docs.
pub fn decide_start(input: &StartInput<'_>) -> Result<Decision, StartError> {
    let volume = input.volume.to_string();
    let uuid = choose_uuid(input)?;
    let known = match &uuid {
        UuidChoice::Given(u) | UuidChoice::Recorded(u) => Some(u.as_str()),
        UuidChoice::New => None,
    };
    let mut reachable = Vec::new();
    let mut absent = Vec::new();
    let mut foreign = Vec::new();
    // What is wrong with the replicas that are not reachable members, for the messages.
    let mut problems = Vec::new();
    let mut foreign_problems = Vec::new();
    for (i, (addr, report)) in input.replicas.iter().enumerate() {
        match report {
            Report::Open(r)
                if known.is_some_and(|u| !r.volume_uuid.is_empty() && r.volume_uuid != u) =>
            {
                foreign.push(i);
                foreign_problems.push(format!(
                    "{addr}: replica {} belongs to volume {}, not to this volume {}; left alone",
                    r.id,
                    r.volume_uuid,
                    known.unwrap_or_default()
                ));
            }
            Report::Open(r) if r.size != input.size => {
                absent.push(i);
                problems.push(format!(
                    "{addr}: size {} differs from the volume size {}",
                    r.size, input.size
                ));
            }
            Report::Open(r) => reachable.push((i, r)),
            Report::Unreachable(why) => {
                absent.push(i);
                problems.push(format!("{addr}: unreachable: {why}"));
            }
        }
    }
    problems.extend(foreign_problems);
    if reachable.is_empty() {
        return Err(StartError::NoneReachable {
            volume,
            details: problems.join("; "),
        });
    }
    let top = reachable
        .iter()
        .map(|(_, r)| r.epoch)
        .max()
        .unwrap_or_default();
    let (current, stale, reason) = if top == Epoch(0) {
        let all = reachable.iter().map(|(i, _)| *i).collect();
        (all, Vec::new(), Reason::FirstStart)
    } else {
        let members: BTreeSet<&ReplicaId> = reachable
            .iter()
            .filter(|(_, r)| r.epoch == top)
            .flat_map(|(_, r)| r.members.iter())
            .collect();
        let (cur, rest): (Vec<_>, Vec<_>) = reachable
            .iter()
            .partition(|(_, r)| r.epoch == top && members.contains(&r.id));
        let present: BTreeSet<&ReplicaId> = cur.iter().map(|(_, r)| &r.id).collect();
        let missing: Vec<&&ReplicaId> = members.iter().filter(|m| !present.contains(*m)).collect();
        let reason = if missing.is_empty() {
            Reason::AllMembers { epoch: top }
        } else {
            let mut details: Vec<String> = missing
                .iter()
                .map(|m| {
                    format!(
                        "member {m} of epoch {} is not among the reachable current replicas",
                        top.0
                    )
                })
                .collect();
            details.extend(rest.iter().map(|(i, r)| {
                format!(
                    "{} (id {}) is at epoch {}, not a member of epoch {}",
                    input.replicas[*i].0, r.id, r.epoch.0, top.0
                )
            }));
            details.extend(problems.iter().cloned());
            let details = details.join("; ");
            if !input.salvage {
                return Err(StartError::NotProvablyCurrent { volume, details });
            }
            Reason::Salvage {
                epoch: top,
                present: cur.len(),
                members: members.len(),
                details,
            }
        };
        let cur: Vec<usize> = cur.iter().map(|(i, _)| *i).collect();
        let rest: Vec<usize> = rest.iter().map(|(i, _)| *i).collect();
        (cur, rest, reason)
    };
    if current.is_empty() {
        let details = stale
            .iter()
            .map(|&i| match &input.replicas[i].1 {
                Report::Open(r) => format!(
                    "{} (id {}) at epoch {} is not a member of epoch {}",
                    input.replicas[i].0, r.id, r.epoch.0, top.0
                ),
                Report::Unreachable(_) => input.replicas[i].0.clone(),
            })
            .chain(problems.iter().cloned())
            .collect::<Vec<_>>()
            .join("; ");
        return Err(StartError::AllStale { volume, details });
    }
    let highest = current
        .iter()
        .filter_map(|&i| match &input.replicas[i].1 {
            Report::Open(r) => Some(r.generation),
            Report::Unreachable(_) => None,
        })
        .max()
        .unwrap_or_default();
    let generation = highest
        .checked_next()
        .map_err(|source| StartError::Exhausted {
            volume: volume.clone(),
            source,
        })?;
    Ok(Decision {
        uuid,
        current,
        stale,
        absent,
        foreign,
        epoch: top,
        generation,
        reason,
    })
}

/// Rule 1 of the module docs.
fn choose_uuid(input: &StartInput<'_>) -> Result<UuidChoice, StartError> {
    if let Some(u) = input.given_uuid {
        return Ok(UuidChoice::Given(u.to_string()));
    }
    let recorded: BTreeSet<(&str, &str)> = input
        .replicas
        .iter()
        .filter_map(|(addr, report)| match report {
            Report::Open(r) if !r.volume_uuid.is_empty() => {
                Some((r.volume_uuid.as_str(), addr.as_str()))
            }
            _ => None,
        })
        .collect();
    let uuids: BTreeSet<&str> = recorded.iter().map(|(u, _)| *u).collect();
    match uuids.len() {
        0 => Ok(UuidChoice::New),
        1 => Ok(UuidChoice::Recorded(
            uuids.first().expect("invariant: one uuid").to_string(),
        )),
        _ => Err(StartError::Identity {
            volume: input.volume.into(),
            details: recorded
                .iter()
                .map(|(u, a)| format!("{a} records {u}"))
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

/// How the current replicas are reconciled: they may differ only in regions written since
/// `since` (the oldest flush any of them completed), and a block that differs is taken from
/// the first replica in `order` (the highest flush number first; equal ones in the order
/// given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReconcilePlan {
    pub since: FlushNumber,
    /// Indices into the flush numbers given.
    pub order: Vec<usize>,
}

/// The reconcile plan for current replicas that report `flushes` (module docs).
pub fn reconcile_plan(flushes: &[FlushNumber]) -> ReconcilePlan {
    let since = flushes.iter().copied().min().unwrap_or_default();
    let mut order: Vec<usize> = (0..flushes.len()).collect();
    // Stable: equal flush numbers keep the order given.
    order.sort_by_key(|&i| std::cmp::Reverse(flushes[i]));
    ReconcilePlan { since, order }
}

#[cfg(test)]
#[path = "decide_tests.rs"]
mod tests;
