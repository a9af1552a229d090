use std::collections::BTreeMap;

use super::*;
use zebu_types::names::ZONE_LABEL;
use zebu_types::resources::{
    ConditionStatus, DiskSpec, DiskStatus, Frontend, NodeSpec, ReplicaSpec, VolumeSpec,
    set_condition,
};

const GIB: u64 = 1 << 30;

/// A ready node with disks `(name, max GiB, available GiB, tags)`.
fn node(name: &str, zone: Option<&str>, disks: &[(&str, u64, u64, &[&str])]) -> Node {
    let mut spec_disks = BTreeMap::new();
    let mut status = BTreeMap::new();
    for (d, max, avail, tags) in disks {
        spec_disks.insert(
            d.to_string(),
            DiskSpec {
                path: format!("/data/{name}/{d}"),
                tags: tags.iter().map(|t| t.to_string()).collect(),
                allow_scheduling: true,
                storage_reserved: ByteSize(0),
            },
        );
        status.insert(
            d.to_string(),
            DiskStatus {
                storage_maximum: ByteSize(max * GIB),
                storage_available: ByteSize(avail * GIB),
                ..Default::default()
            },
        );
    }
    let mut n = Node::new(
        name,
        NodeSpec {
            address: "127.0.0.10".into(),
            disks: spec_disks,
            tags: vec![],
            allow_scheduling: true,
        },
    );
    if let Some(z) = zone {
        n.metadata.labels.insert(ZONE_LABEL.into(), z.into());
    }
    n.status.disk_status = status;
    set_condition(
        &mut n.status.conditions,
        "Ready",
        ConditionStatus::True,
        "",
        "",
    );
    n
}

fn plain_nodes(k: usize) -> Vec<Node> {
    (1..=k)
        .map(|i| node(&format!("node-{i}"), None, &[("disk-a", 100, 100, &[])]))
        .collect()
}

fn volume(name: &str, gib: u64, replicas: u32) -> Volume {
    Volume::new(
        name,
        VolumeSpec {
            size: ByteSize(gib * GIB),
            number_of_replicas: replicas,
            frontend: Frontend::Nbd,
            node_selector: vec![],
            disk_selector: vec![],
            data_locality: DataLocality::Disabled,
            stale_replica_timeout: 60,
            node_id: None,
            disable_frontend: false,
        },
    )
}

fn replica(volume: &str, node: &str, disk: &str, gib: u64) -> Replica {
    Replica::new(
        format!("{volume}-r-{node}-{disk}"),
        ReplicaSpec {
            volume: volume.into(),
            node: node.into(),
            disk: disk.into(),
            data_path: String::new(),
            size: ByteSize(gib * GIB),
        },
    )
}

fn run(
    v: &Volume,
    nodes: &[Node],
    replicas: &[Replica],
    s: &Settings,
    count: u32,
) -> Result<Vec<Placement>, ScheduleError> {
    schedule(&ScheduleRequest {
        volume: v,
        nodes,
        replicas,
        settings: s,
        count,
    })
}

fn node_names(p: &[Placement]) -> Vec<&str> {
    p.iter().map(|p| p.node.as_str()).collect()
}

#[test]
fn three_replicas_go_to_three_nodes() {
    let p = run(
        &volume("v", 10, 3),
        &plain_nodes(3),
        &[],
        &Settings::default(),
        3,
    )
    .expect("fits");
    assert_eq!(node_names(&p), ["node-1", "node-2", "node-3"]);
    assert_eq!(p[0].disk_path, "/data/node-1/disk-a");
}

#[test]
fn hard_node_anti_affinity_names_the_shortfall() {
    let err = run(
        &volume("v", 10, 3),
        &plain_nodes(2),
        &[],
        &Settings::default(),
        3,
    )
    .expect_err("two nodes cannot hold three replicas");
    assert_eq!(
        err.to_string(),
        "cannot schedule replica 3 of volume v: 2 nodes, hard node anti-affinity needs 3"
    );
}

#[test]
fn soft_node_anti_affinity_doubles_up_on_a_different_disk() {
    let nodes = vec![
        node(
            "node-1",
            None,
            &[("disk-a", 100, 100, &[]), ("disk-b", 100, 100, &[])],
        ),
        node("node-2", None, &[("disk-a", 100, 100, &[])]),
    ];
    let s = Settings {
        replica_soft_anti_affinity: true,
        ..Settings::default()
    };
    let p = run(&volume("v", 10, 3), &nodes, &[], &s, 3).expect("fits");
    let mut disks: Vec<_> = p
        .iter()
        .map(|p| (p.node.as_str(), p.disk.as_str()))
        .collect();
    disks.sort();
    assert_eq!(
        disks,
        [
            ("node-1", "disk-a"),
            ("node-1", "disk-b"),
            ("node-2", "disk-a")
        ]
    );
}

#[test]
fn hard_disk_anti_affinity_refuses_a_second_replica_on_one_disk() {
    let nodes = vec![node(
        "node-1",
        None,
        &[("disk-a", 100, 100, &[]), ("disk-b", 100, 100, &[])],
    )];
    let s = Settings {
        replica_soft_anti_affinity: true,
        replica_disk_soft_anti_affinity: false,
        ..Settings::default()
    };
    let err = run(&volume("v", 10, 3), &nodes, &[], &s, 3).expect_err("two disks");
    assert_eq!(
        err.to_string(),
        "cannot schedule replica 3 of volume v: 2 usable disks, hard disk anti-affinity needs 3"
    );
    // Soft disk anti-affinity lets the third share a disk.
    let s = Settings {
        replica_disk_soft_anti_affinity: true,
        ..s
    };
    assert_eq!(
        run(&volume("v", 10, 3), &nodes, &[], &s, 3).map(|p| p.len()),
        Ok(3)
    );
}

#[test]
fn soft_zone_anti_affinity_prefers_a_new_zone_over_more_space() {
    let nodes = vec![
        node("node-1", Some("a"), &[("disk-a", 100, 100, &[])]),
        node("node-2", Some("a"), &[("disk-a", 900, 900, &[])]),
        node("node-3", Some("b"), &[("disk-a", 50, 50, &[])]),
    ];
    let p = run(&volume("v", 10, 2), &nodes, &[], &Settings::default(), 2).expect("fits");
    // node-2 has the most room; the second replica still goes to zone b.
    assert_eq!(node_names(&p), ["node-2", "node-3"]);
}

#[test]
fn hard_zone_anti_affinity_names_the_shortfall() {
    let nodes = vec![
        node("node-1", Some("a"), &[("disk-a", 100, 100, &[])]),
        node("node-2", Some("a"), &[("disk-a", 100, 100, &[])]),
        node("node-3", Some("b"), &[("disk-a", 100, 100, &[])]),
    ];
    let s = Settings {
        replica_zone_soft_anti_affinity: false,
        ..Settings::default()
    };
    let err = run(&volume("v", 10, 3), &nodes, &[], &s, 3).expect_err("two zones");
    assert_eq!(
        err.to_string(),
        "cannot schedule replica 3 of volume v: 2 zones, hard zone anti-affinity needs 3"
    );
}

#[test]
fn over_provisioning_limits_promised_bytes() {
    // 30 GiB disk, 15 GiB already promised to another volume, 20 GiB wanted.
    let nodes = vec![node("node-1", None, &[("disk-a", 30, 30, &[])])];
    let others = vec![replica("other", "node-1", "disk-a", 15)];
    let v = volume("v", 20, 1);
    let err = run(&v, &nodes, &others, &Settings::default(), 1).expect_err("100% is full");
    assert_eq!(
        err.to_string(),
        "cannot schedule replica 1 of volume v: no disk has 20 GiB available under 100% \
         over-provisioning: node-1/disk-a has 15 GiB of 30 GiB schedulable left"
    );
    let s = Settings {
        storage_over_provisioning_percentage: 200,
        ..Settings::default()
    };
    let p = run(&v, &nodes, &others, &s, 1).expect("200% fits");
    assert_eq!(node_names(&p), ["node-1"]);
}

#[test]
fn over_provisioning_counts_replicas_placed_in_the_same_call() {
    // Soft node anti-affinity and one 30 GiB disk: two 10 GiB replicas fit,
    // a third would overshoot only because of the first two.
    let nodes = vec![node("node-1", None, &[("disk-a", 25, 25, &[])])];
    let s = Settings {
        replica_soft_anti_affinity: true,
        ..Settings::default()
    };
    let err = run(&volume("v", 10, 3), &nodes, &[], &s, 3).expect_err("third overshoots");
    assert!(
        matches!(err, ScheduleError::NoDiskFits { replica: 3, .. }),
        "{err}"
    );
}

#[test]
fn minimal_available_percentage_skips_full_disks() {
    let nodes = vec![
        node("node-1", None, &[("disk-a", 100, 20, &[])]),
        node("node-2", None, &[("disk-a", 100, 30, &[])]),
    ];
    let p = run(&volume("v", 10, 1), &nodes, &[], &Settings::default(), 1).expect("fits");
    assert_eq!(node_names(&p), ["node-2"]);
    let err = run(&volume("v", 10, 2), &nodes, &[], &Settings::default(), 2).expect_err("full");
    assert_eq!(
        err.to_string(),
        "cannot schedule replica 2 of volume v: 1 nodes, hard node anti-affinity needs 2 \
         (not usable: node-1/disk-a has 20 GiB free of 100 GiB, below the 25% minimum)"
    );
}

#[test]
fn storage_reserved_is_taken_off_both_tests() {
    let mut n = node("node-1", None, &[("disk-a", 100, 100, &[])]);
    n.spec
        .disks
        .get_mut("disk-a")
        .expect("disk")
        .storage_reserved = ByteSize(95 * GIB);
    let err = run(&volume("v", 10, 1), &[n], &[], &Settings::default(), 1).expect_err("reserved");
    assert!(
        err.to_string()
            .contains("has 5 GiB of 5 GiB schedulable left"),
        "{err}"
    );
}

#[test]
fn disk_and_node_tags_select() {
    let mut nodes = vec![
        node("node-1", None, &[("disk-a", 100, 100, &["hdd"])]),
        node("node-2", None, &[("disk-a", 100, 100, &["ssd"])]),
        node("node-3", None, &[("disk-a", 900, 900, &["ssd"])]),
    ];
    nodes[2].spec.tags = vec!["edge".into()];
    let mut v = volume("v", 10, 1);
    v.spec.disk_selector = vec!["ssd".into()];
    let p = run(&v, &nodes, &[], &Settings::default(), 1).expect("fits");
    assert_eq!(node_names(&p), ["node-3"], "ssd with the most room");
    v.spec.node_selector = vec!["core".into()];
    let err = run(&v, &nodes, &[], &Settings::default(), 1).expect_err("no core node");
    let text = err.to_string();
    assert!(
        text.contains("node-3 is tagged [edge], volume needs node tags [core]"),
        "{text}"
    );
    v.spec.node_selector = vec![];
    v.spec.disk_selector = vec!["nvme".into()];
    let err = run(&v, &nodes, &[], &Settings::default(), 1).expect_err("no nvme");
    assert!(
        err.to_string()
            .contains("node-1/disk-a is tagged [hdd], volume needs disk tags [nvme]"),
        "{err}"
    );
}

#[test]
fn best_effort_data_locality_puts_one_replica_on_the_attach_node() {
    let nodes = vec![
        node("node-1", None, &[("disk-a", 900, 900, &[])]),
        node("node-2", None, &[("disk-a", 900, 900, &[])]),
        node("node-3", None, &[("disk-a", 100, 100, &[])]),
    ];
    let mut v = volume("v", 10, 2);
    v.spec.node_id = Some("node-3".into());
    let p = run(&v, &nodes, &[], &Settings::default(), 2).expect("fits");
    assert_eq!(
        node_names(&p),
        ["node-1", "node-2"],
        "disabled: most room wins"
    );
    v.spec.data_locality = DataLocality::BestEffort;
    let p = run(&v, &nodes, &[], &Settings::default(), 2).expect("fits");
    assert_eq!(node_names(&p), ["node-3", "node-1"]);
    // Already local: no preference any more.
    let existing = vec![replica("v", "node-3", "disk-a", 10)];
    let p = run(&v, &nodes, &existing, &Settings::default(), 1).expect("fits");
    assert_eq!(node_names(&p), ["node-1"]);
}

#[test]
fn unready_and_unschedulable_nodes_and_disks_are_skipped() {
    let mut nodes = plain_nodes(4);
    set_condition(
        &mut nodes[0].status.conditions,
        "Ready",
        ConditionStatus::False,
        "",
        "",
    );
    nodes[1].spec.allow_scheduling = false;
    nodes[2]
        .spec
        .disks
        .get_mut("disk-a")
        .expect("disk")
        .allow_scheduling = false;
    nodes[3].status.disk_status.clear();
    let err = run(&volume("v", 1, 1), &nodes, &[], &Settings::default(), 1).expect_err("none");
    let text = err.to_string();
    for want in [
        "node-1 is not ready",
        "node-2 has scheduling disabled",
        "node-3/disk-a has scheduling disabled",
        "node-4/disk-a has not reported its capacity",
    ] {
        assert!(text.contains(want), "{want:?} missing from {text}");
    }
}

#[test]
fn existing_replicas_count_for_anti_affinity_and_numbering() {
    let existing = vec![
        replica("v", "node-1", "disk-a", 10),
        replica("v", "node-2", "disk-a", 10),
    ];
    let p = run(
        &volume("v", 10, 3),
        &plain_nodes(3),
        &existing,
        &Settings::default(),
        1,
    )
    .expect("fits");
    assert_eq!(node_names(&p), ["node-3"]);
    let err = run(
        &volume("v", 10, 4),
        &plain_nodes(3),
        &existing,
        &Settings::default(),
        2,
    )
    .expect_err("three nodes");
    assert_eq!(
        err.to_string(),
        "cannot schedule replica 4 of volume v: 3 nodes, hard node anti-affinity needs 4"
    );
    // A replica being deleted does not block its node.
    let mut going = existing.clone();
    going[1].metadata.deletion_timestamp = Some("2025-01-01T00:00:00Z".into());
    let p = run(
        &volume("v", 10, 3),
        &plain_nodes(2),
        &going,
        &Settings::default(),
        1,
    )
    .expect("node-2 is free again");
    assert_eq!(node_names(&p), ["node-2"]);
}

#[test]
fn no_nodes_is_its_own_error() {
    let err = run(&volume("v", 1, 1), &[], &[], &Settings::default(), 1).expect_err("empty");
    assert_eq!(
        err.to_string(),
        "cannot schedule replica 1 of volume v: there are no nodes"
    );
}
