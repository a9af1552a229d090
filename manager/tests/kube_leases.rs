//! Leases against a real kube-apiserver, with only the rights the chart's Role gives: three
//! managers' Lease loops (`zebu_manager::cluster`) keep their node Leases and share the
//! cluster Lease. Exactly one leads at any time; when the leader is killed (its loop stops
//! dead, nothing released) the others see its node down once its Lease ran out, and one of
//! them takes the cluster Lease over; the killed one back renews its own Lease at once and
//! does not take the lead back. A manager without rights says which verb on which resource
//! was refused, and keeps running.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use zebu_controllers::{Membership, Presence};
use zebu_manager::cluster::lease::{LEASE_DURATION, LeaseClient, node_lease_name};
use zebu_manager::cluster::{LeaseMembership, kube_client, run_leases};

mod k8s;
use k8s::Cluster;

struct Member {
    m: Arc<LeaseMembership>,
    task: tokio::task::JoinHandle<()>,
    _stop: watch::Sender<bool>,
}

fn start(client: &::kube::Client, node: &str, cluster_lease: &str) -> Member {
    let m = LeaseMembership::with_cluster_lease(node.to_string(), cluster_lease.to_string());
    let (stop, rx) = watch::channel(false);
    let task = tokio::spawn(run_leases(client.clone(), m.clone(), rx));
    Member {
        m,
        task,
        _stop: stop,
    }
}

fn leaders(ms: &[Member]) -> Vec<String> {
    ms.iter()
        .filter(|x| x.m.leads())
        .map(|x| x.m.node().to_string())
        .collect()
}

/// Poll every 200 ms until `done`, asserting at every poll that at most one member leads.
async fn until(
    what: &str,
    secs: u64,
    ms: &[Member],
    mut done: impl FnMut(&[Member]) -> bool,
) -> Duration {
    let t0 = Instant::now();
    loop {
        let l = leaders(ms);
        assert!(l.len() <= 1, "two leaders at once: {l:?}");
        if done(ms) {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "{what}: not within {secs} s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn sees_up(m: &LeaseMembership, node: &str) -> bool {
    m.presence().get(node) == Some(&Presence::Up)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_managers_share_the_cluster_lease_and_see_each_other_by_node_leases() {
    let c = Cluster::ensure();
    c.install();
    let client = kube_client(Some(&c.manager())).await.expect("client");
    let tag = format!("l{}", std::process::id());
    let nodes: Vec<String> = (1..=3).map(|i| format!("{tag}-node-{i}")).collect();
    let cluster_lease = format!("zebu-cluster-{tag}");
    let mut ms: Vec<Member> = nodes
        .iter()
        .map(|n| start(&client, n, &cluster_lease))
        .collect();

    until("every member up and seeing the others", 40, &ms, |ms| {
        ms.iter()
            .all(|x| x.m.may_act() && nodes.iter().all(|n| sees_up(&x.m, n)))
    })
    .await;
    until("one leader", 40, &ms, |ms| leaders(ms).len() == 1).await;
    let first = leaders(&ms)[0].clone();
    let li = nodes.iter().position(|n| *n == first).expect("leader");

    // kill -9 of the leader, as far as Leases go: its loop stops dead, nothing released.
    ms[li].task.abort();
    let killed = Instant::now();
    let took = until("another leader", 60, &ms, |ms| {
        leaders(ms).first().is_some_and(|l| *l != first)
    })
    .await;
    let second = leaders(&ms)[0].clone();
    eprintln!("{first} killed; {second} leads after {took:?}");
    // Not before the Lease ran out (less the renew interval the last renew may have been
    // before the kill), and not much after.
    assert!(took >= LEASE_DURATION - Duration::from_secs(3), "{took:?}");
    assert!(took <= LEASE_DURATION + Duration::from_secs(15), "{took:?}");
    // The killed one stopped counting itself as leader well before (its renew deadline).
    assert!(!ms[li].m.leads());
    assert!(!ms[li].m.may_act());
    for (i, x) in ms.iter().enumerate() {
        if i != li {
            match x.m.presence().get(&first) {
                Some(Presence::Down { since: Some(_) }) => {}
                p => panic!("{} sees {first} as {p:?}", x.m.node()),
            }
        }
    }
    assert!(killed.elapsed() >= took);

    // It comes back: its own Lease is renewed at once (it holds it), the others see it up,
    // and the lead stays where it went.
    ms[li] = start(&client, &first, &cluster_lease);
    until("the returned member seen up", 30, &ms, |ms| {
        ms.iter().all(|x| sees_up(&x.m, &first))
    })
    .await;
    let t0 = Instant::now();
    until("a steady lead", 8, &ms, |ms| {
        assert_eq!(leaders(ms), vec![second.clone()], "the lead moved back");
        t0.elapsed() > Duration::from_secs(6)
    })
    .await;
    for x in &ms {
        x.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manager_without_rights_names_the_refused_verb_and_resource_and_keeps_running() {
    let c = Cluster::ensure();
    c.install();
    let client = kube_client(Some(&c.norights())).await.expect("client");
    let mut leases = LeaseClient::new(client.clone());
    let node = format!("n{}-node-1", std::process::id());
    let err = leases
        .acquire_or_renew(&node_lease_name(&node), &node)
        .await
        .expect_err("no rights");
    let text = err.to_string();
    eprintln!("{text}");
    assert!(text.contains("cannot get resource \"leases\""), "{text}");
    assert!(text.contains("coordination.k8s.io"), "{text}");
    assert!(text.contains(c.get("ZEBU_K8S_NORIGHTS_USER")), "{text}");

    let m = start(
        &client,
        &node,
        &format!("zebu-cluster-n{}", std::process::id()),
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!m.task.is_finished(), "the Lease loop gave up");
    assert!(!m.m.may_act(), "acting without a Lease");
    assert!(!m.m.leads());
    m.task.abort();
}
