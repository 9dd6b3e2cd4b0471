//! One AFL++ harness for every target: `FERRUM_FUZZ_TARGET` names it (scripts/fuzz.sh sets it).

#[global_allocator]
static ALLOC: ferrum_core::alloc::Metered = ferrum_core::alloc::Metered;

fn main() {
    let name = std::env::var("FERRUM_FUZZ_TARGET").unwrap_or_default();
    // `target --seeds DIR`: write the target's seed inputs there (AFL++'s -i folder).
    let args: Vec<String> = std::env::args().collect();
    let Some(t) = ferrum_fuzz::target(&name) else {
        let names: Vec<&str> = ferrum_fuzz::TARGETS.iter().map(|t| t.name).collect();
        eprintln!("FERRUM_FUZZ_TARGET must be one of {names:?}");
        std::process::exit(2);
    };
    if let [_, flag, dir] = args.as_slice() {
        if flag == "--seeds" {
            std::fs::create_dir_all(dir).expect("the seeds folder");
            for (i, s) in (t.seeds)().iter().enumerate() {
                std::fs::write(format!("{dir}/seed{i}"), s).expect("a seed file");
            }
            return;
        }
    }
    ferrum_fuzz::EXIT_AFTER_STOPPED_RENDER.store(true, std::sync::atomic::Ordering::Relaxed);
    afl::fuzz!(|data: &[u8]| {
        (t.run)(data);
    });
}
