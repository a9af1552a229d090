//! The start decision, case by case: every case `start.rs` distinguishes, and the refusals.

use super::*;

const SIZE: u64 = 1 << 30;
const UUID: &str = "0f1e2d3c-0000-4000-8000-000000000001";
const OTHER: &str = "0f1e2d3c-0000-4000-8000-000000000002";

/// A replica of this volume with id `id`, at `epoch` naming `members`, at generation `g`.
fn at(id: &str, epoch: u64, members: &[&str], g: u64) -> Report {
    Report::Open(Reported {
        id: ReplicaId::from(id),
        volume_uuid: UUID.into(),
        size: SIZE,
        epoch: Epoch(epoch),
        members: members.iter().map(|m| ReplicaId::from(*m)).collect(),
        generation: Generation(g),
    })
}

fn fresh(id: &str) -> Report {
    Report::Open(Reported {
        id: ReplicaId::from(id),
        size: SIZE,
        ..Reported::default()
    })
}

fn with(r: Report, f: impl FnOnce(&mut Reported)) -> Report {
    match r {
        Report::Open(mut x) => {
            f(&mut x);
            Report::Open(x)
        }
        u => u,
    }
}

fn gone() -> Report {
    Report::Unreachable("connect refused".into())
}

/// What a case expects: the decision's sets and reason, or the refusal's kind and words.
#[derive(Debug)]
enum Want {
    Serve {
        current: &'static [usize],
        stale: &'static [usize],
        absent: &'static [usize],
        foreign: &'static [usize],
        generation: u64,
        reason: &'static str,
    },
    Refuse {
        kind: &'static str,
        words: &'static [&'static str],
    },
}

struct Case {
    name: &'static str,
    given: Option<&'static str>,
    salvage: bool,
    replicas: Vec<Report>,
    want: Want,
}

fn refusal_kind(e: &StartError) -> &'static str {
    match e {
        StartError::NoneReachable { .. } => "none reachable",
        StartError::NotProvablyCurrent { .. } => "not provably current",
        StartError::Identity { .. } => "identity",
        StartError::AllStale { .. } => "all stale",
        StartError::Exhausted { .. } => "exhausted",
        StartError::Replica { .. } => "replica",
        StartError::Reconcile { .. } => "reconcile",
    }
}

fn cases() -> Vec<Case> {
    let abc = &["a", "b", "c"];
    vec![
        Case {
            name: "first start: no epoch anywhere, every replica is current",
            given: None,
            salvage: false,
            replicas: vec![fresh("a"), fresh("b"), fresh("c")],
            want: Want::Serve {
                current: &[0, 1, 2],
                stale: &[],
                absent: &[],
                foreign: &[],
                generation: 1,
                reason: "first start",
            },
        },
        Case {
            name: "every member of the top epoch is reachable at it",
            given: None,
            salvage: false,
            replicas: vec![at("a", 4, abc, 7), at("b", 4, abc, 9), at("c", 4, abc, 8)],
            want: Want::Serve {
                current: &[0, 1, 2],
                stale: &[],
                absent: &[],
                foreign: &[],
                generation: 10,
                reason: "every member of epoch 4",
            },
        },
        Case {
            name: "a replica dropped in an earlier epoch is stale, the members are current",
            given: None,
            salvage: false,
            replicas: vec![
                at("a", 5, &["a", "b"], 3),
                at("b", 5, &["a", "b"], 3),
                at("c", 4, abc, 2),
            ],
            want: Want::Serve {
                current: &[0, 1],
                stale: &[2],
                absent: &[],
                foreign: &[],
                generation: 4,
                reason: "every member of epoch 5",
            },
        },
        Case {
            name: "a replica at the top epoch that its members do not name is stale",
            given: None,
            salvage: false,
            replicas: vec![at("a", 5, &["a"], 1), at("x", 5, &["x2"], 1)],
            want: Want::Refuse {
                kind: "not provably current",
                words: &["member x2 of epoch 5", "--salvage"],
            },
        },
        Case {
            name: "a missing member refuses the start and names it",
            given: None,
            salvage: false,
            replicas: vec![at("a", 6, abc, 1), at("b", 6, abc, 1), gone()],
            want: Want::Refuse {
                kind: "not provably current",
                words: &[
                    "member c of epoch 6 is not among the reachable current replicas",
                    "r2: unreachable: connect refused",
                    "--salvage",
                ],
            },
        },
        Case {
            name: "a missing member with salvage proceeds with the members present",
            given: None,
            salvage: true,
            replicas: vec![at("a", 6, abc, 1), at("b", 6, abc, 2), gone()],
            want: Want::Serve {
                current: &[0, 1],
                stale: &[],
                absent: &[2],
                foreign: &[],
                generation: 3,
                reason: "SALVAGE requested: serving from 2 of 3 members of epoch 6",
            },
        },
        Case {
            name: "salvage also names a non-member at a lower epoch, which stays stale",
            given: None,
            salvage: true,
            replicas: vec![at("a", 6, &["a", "b"], 1), at("c", 2, abc, 1)],
            want: Want::Serve {
                current: &[0],
                stale: &[1],
                absent: &[],
                foreign: &[],
                generation: 2,
                reason: "r1 (id c) is at epoch 2, not a member of epoch 6",
            },
        },
        Case {
            name: "no replica reachable",
            given: None,
            salvage: true,
            replicas: vec![gone(), gone()],
            want: Want::Refuse {
                kind: "none reachable",
                words: &["r0: unreachable", "r1: unreachable"],
            },
        },
        Case {
            name: "a replica of another size is handed back for a rebuild",
            given: None,
            salvage: false,
            replicas: vec![fresh("a"), with(fresh("b"), |r| r.size = SIZE / 2)],
            want: Want::Serve {
                current: &[0],
                stale: &[],
                absent: &[1],
                foreign: &[],
                generation: 1,
                reason: "first start",
            },
        },
        Case {
            name: "only replicas of another size: none reachable",
            given: None,
            salvage: false,
            replicas: vec![with(fresh("a"), |r| r.size = 4096)],
            want: Want::Refuse {
                kind: "none reachable",
                words: &["r0: size 4096 differs from the volume size 1073741824"],
            },
        },
        Case {
            name: "the replicas record different uuids: refused",
            given: None,
            salvage: true,
            replicas: vec![
                at("a", 1, &["a"], 1),
                with(at("b", 1, &["b"], 1), |r| r.volume_uuid = OTHER.into()),
            ],
            want: Want::Refuse {
                kind: "identity",
                words: &["r0 records 0f1e2d3c", "r1 records", "--volume-uuid"],
            },
        },
        Case {
            name: "a foreign replica beside the given uuid's is left alone, not rebuilt",
            given: Some(UUID),
            salvage: false,
            replicas: vec![
                at("a", 3, &["a"], 1),
                with(at("z", 9, &["z"], 50), |r| r.volume_uuid = OTHER.into()),
            ],
            want: Want::Serve {
                current: &[0],
                stale: &[],
                absent: &[],
                foreign: &[1],
                generation: 2,
                reason: "every member of epoch 3",
            },
        },
        Case {
            name: "only foreign replicas: none reachable, and they are named",
            given: Some(OTHER),
            salvage: true,
            replicas: vec![at("a", 3, &["a"], 1)],
            want: Want::Refuse {
                kind: "none reachable",
                words: &[
                    "r0: replica a belongs to volume 0f1e2d3c-0000-4000-8000-000000000001, not to this volume 0f1e2d3c-0000-4000-8000-000000000002; left alone",
                ],
            },
        },
        Case {
            name: "a replica that records no uuid (made before identity) is this volume's",
            given: None,
            salvage: false,
            replicas: vec![
                at("a", 2, &["a", "b"], 1),
                with(at("b", 2, &["a", "b"], 1), |r| r.volume_uuid.clear()),
            ],
            want: Want::Serve {
                current: &[0, 1],
                stale: &[],
                absent: &[],
                foreign: &[],
                generation: 2,
                reason: "every member of epoch 2",
            },
        },
        Case {
            name: "every reachable replica stale: refused even with salvage",
            given: None,
            salvage: true,
            replicas: vec![at("a", 7, &["q"], 1), at("b", 3, &["a", "b"], 1)],
            want: Want::Refuse {
                kind: "all stale",
                words: &["r0 (id a) at epoch 7", "r1 (id b) at epoch 3"],
            },
        },
        Case {
            name: "an epoch that names no member: nothing is current",
            given: None,
            salvage: false,
            replicas: vec![at("a", 7, &[], 1)],
            want: Want::Refuse {
                kind: "all stale",
                words: &["r0 (id a) at epoch 7 is not a member of epoch 7"],
            },
        },
        Case {
            name: "a generation at the ceiling cannot be raised: refused",
            given: None,
            salvage: false,
            replicas: vec![at("a", 1, &["a"], u64::MAX - 1)],
            want: Want::Refuse {
                kind: "exhausted",
                words: &["generation", "no successor"],
            },
        },
        Case {
            name: "the generation is raised over the current replicas only",
            given: None,
            salvage: false,
            replicas: vec![at("a", 5, &["a"], 3), at("b", 4, &["a", "b"], 40)],
            want: Want::Serve {
                current: &[0],
                stale: &[1],
                absent: &[],
                foreign: &[],
                generation: 4,
                reason: "every member of epoch 5",
            },
        },
    ]
}

#[test]
fn start_decision_table() {
    for case in cases() {
        let replicas: Vec<(String, Report)> = case
            .replicas
            .iter()
            .enumerate()
            .map(|(i, r)| (format!("r{i}"), r.clone()))
            .collect();
        let input = StartInput {
            volume: "v",
            given_uuid: case.given,
            size: SIZE,
            salvage: case.salvage,
            replicas: &replicas,
        };
        let got = decide_start(&input);
        match (&case.want, got) {
            (
                Want::Serve {
                    current,
                    stale,
                    absent,
                    foreign,
                    generation,
                    reason,
                },
                Ok(d),
            ) => {
                assert_eq!(d.current, *current, "{}: current", case.name);
                assert_eq!(d.stale, *stale, "{}: stale", case.name);
                assert_eq!(d.absent, *absent, "{}: absent", case.name);
                assert_eq!(d.foreign, *foreign, "{}: foreign", case.name);
                assert_eq!(d.generation, Generation(*generation), "{}", case.name);
                let why = d.reason.to_string();
                assert!(why.contains(reason), "{}: reason {why:?}", case.name);
            }
            (Want::Refuse { kind, words }, Err(e)) => {
                assert_eq!(refusal_kind(&e), *kind, "{}: {e}", case.name);
                let text = e.to_string();
                for w in *words {
                    assert!(text.contains(w), "{}: {w:?} not in {text:?}", case.name);
                }
            }
            (want, got) => panic!("{}: wanted {want:?}, got {got:?}", case.name),
        }
    }
}

#[test]
fn the_uuid_is_the_given_one_then_the_recorded_one_then_new() {
    let decide = |given: Option<&str>, reps: &[Report]| {
        let replicas: Vec<(String, Report)> = reps
            .iter()
            .enumerate()
            .map(|(i, r)| (format!("r{i}"), r.clone()))
            .collect();
        decide_start(&StartInput {
            volume: "v",
            given_uuid: given,
            size: SIZE,
            salvage: false,
            replicas: &replicas,
        })
        .expect("the start is decided")
        .uuid
    };
    let recorded = at("a", 1, &["a"], 1);
    assert_eq!(
        decide(Some(UUID), std::slice::from_ref(&recorded)),
        UuidChoice::Given(UUID.into())
    );
    assert_eq!(
        decide(None, &[recorded, fresh("b")]),
        UuidChoice::Recorded(UUID.into())
    );
    assert_eq!(decide(None, &[fresh("a"), gone()]), UuidChoice::New);
}

#[test]
fn reconcile_prefers_the_highest_flush_and_starts_at_the_oldest() {
    let plan = reconcile_plan(&[
        FlushNumber(7),
        FlushNumber(9),
        FlushNumber(7),
        FlushNumber(3),
    ]);
    assert_eq!(plan.since, FlushNumber(3));
    // Equal flush numbers keep the order given.
    assert_eq!(plan.order, vec![1, 0, 2, 3]);
    let one = reconcile_plan(&[FlushNumber(5)]);
    assert_eq!((one.since, one.order), (FlushNumber(5), vec![0]));
}
