//! Stop strings over streamed text (OpenAI's `stop`, vLLM's `stop` without
//! `include_stop_str_in_output`).
//!
//! Text arrives in deltas and a stop string may straddle them, so [`StopMatcher`] holds back
//! the shortest tail that could still grow into a stop string and emits everything before
//! it. When a stop string completes, the text before it is emitted and the stop string
//! itself never is. A held-back tail is released as soon as it can no longer start a match,
//! or by [`StopMatcher::flush`] when generation ends for another reason.

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopOutcome {
    /// Text that is safe to show now.
    pub emit: String,
    /// A stop string completed; nothing more will be emitted.
    pub stopped: bool,
}

#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text not yet emitted: a tail that is a prefix of some stop string.
    held: String,
    /// Index into `stops` of the string that matched.
    matched: Option<usize>,
}

impl StopMatcher {
    /// Empty strings are ignored (they would match everywhere).
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            matched: None,
        }
    }

    pub fn push(&mut self, delta: &str) -> StopOutcome {
        if self.matched.is_some() {
            return StopOutcome {
                emit: String::new(),
                stopped: true,
            };
        }
        self.held.push_str(delta);
        // The earliest match wins: what comes before it is the text the user sees.
        let first = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|at| (at, i)))
            .min();
        if let Some((at, i)) = first {
            self.matched = Some(i);
            let mut emit = std::mem::take(&mut self.held);
            emit.truncate(at);
            return StopOutcome {
                emit,
                stopped: true,
            };
        }
        // Hold back from the earliest position whose suffix could still become a stop
        // string; earlier positions can never start one, whatever comes next.
        let cut = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&self.held[i..])))
            .unwrap_or(self.held.len());
        let rest = self.held.split_off(cut);
        StopOutcome {
            emit: std::mem::replace(&mut self.held, rest),
            stopped: false,
        }
    }

    /// The held-back text, at the end of generation. Empty once a stop string matched.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// The stop string that ended the text, if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(stops.iter().map(|s| s.to_string()).collect())
    }

    fn out(emit: &str, stopped: bool) -> StopOutcome {
        StopOutcome {
            emit: emit.into(),
            stopped,
        }
    }

    #[test]
    fn a_stop_split_across_three_deltas() {
        let mut m = matcher(&["</end>"]);
        assert_eq!(m.push("hello </"), out("hello ", false));
        assert_eq!(m.push("en"), out("", false));
        assert_eq!(m.push("d> world"), out("", true));
        assert_eq!(m.matched(), Some("</end>"));
        assert_eq!(m.push("more"), out("", true));
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn a_held_prefix_that_does_not_match_is_released() {
        let mut m = matcher(&["STOP"]);
        assert_eq!(m.push("abc ST"), out("abc ", false));
        assert_eq!(m.push("ART"), out("START", false));
        // Held back at the end, then flushed.
        assert_eq!(m.push(" S"), out(" ", false));
        assert_eq!(m.flush(), "S");
        assert_eq!(m.matched(), None);
    }

    #[test]
    fn overlapping_candidates_keep_the_earliest_possible_start() {
        // With a self-overlapping stop string, only the longest tail that could start it is
        // held back, never text before it.
        let mut m = matcher(&["aaab"]);
        assert_eq!(m.push("xaa"), out("x", false));
        assert_eq!(m.push("a"), out("", false));
        assert_eq!(m.push("a"), out("a", false)); // "aaaa": only the last three can start it
        assert_eq!(m.push("b tail"), out("", true));
    }

    #[test]
    fn multiple_stop_strings() {
        let mut m = matcher(&["world", "lo w"]);
        assert_eq!(m.push("hello world"), out("hel", true));
        assert_eq!(m.matched(), Some("lo w"));

        let mut m = matcher(&["abc", "xyz", ""]);
        assert_eq!(m.push("1 ab"), out("1 ", false));
        assert_eq!(m.push("d x"), out("abd ", false));
        assert_eq!(m.push("yz!"), out("", true));
        assert_eq!(m.matched(), Some("xyz"));
    }

    #[test]
    fn no_stops_pass_everything_through() {
        let mut m = matcher(&[]);
        assert_eq!(m.push("anything"), out("anything", false));
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn unicode() {
        let mut m = matcher(&["。終", "éé"]);
        assert_eq!(m.push("日本語。"), out("日本語", false));
        assert_eq!(m.push("終わり"), out("", true));

        let mut m = matcher(&["éé"]);
        assert_eq!(m.push("caf é"), out("caf ", false));
        assert_eq!(m.push("!"), out("é!", false));
        assert_eq!(m.push("éè"), out("éè", false));
        assert_eq!(m.push("🦀é"), out("🦀", false));
        assert_eq!(m.push("é"), out("", true));
    }
}
