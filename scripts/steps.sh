# Sourced by the device scripts: `step NAME COMMAND...` runs COMMAND once into the folder $root, its output appended
# to $root/log (Python's warnings left out: their "...Warning: " line and an indented `warn...(` source line under
# it, not pytest's summary line, which counts them); a step that finished (NAME.done) is skipped, so a script run
# again after a lost call, or with OUT set to bring the results back, continues where it stopped. A failed step is
# logged and retried by the next run. ONLY (default: all) names the steps to run this time, e.g. ONLY="he-t0-b1 verify".
step() {  # (its variable is _step: the scripts' own names stay theirs)
  _step=$1; shift
  [ -f $root/$_step.done ] && return 0
  case " ${ONLY:-$_step} " in *" $_step "*) ;; *) return 0 ;; esac
  echo "== $_step $(date +%T): $*" >> $root/log
  { "$@" 2>&1; echo $? > $root/$_step.rc; } | grep --line-buffered -v -E 'Warning: |^ +warn' >> $root/log
  [ "$(cat $root/$_step.rc)" = 0 ] && touch $root/$_step.done || echo "== $_step failed $(date +%T)" >> $root/log
}
