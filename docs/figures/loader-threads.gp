set terminal pngcairo size 900,540
set output 'docs/figures/loader-threads.png'
set datafile separator ','
set grid
set key below
set xlabel 'loader threads'
set logscale x 2
set ylabel 'images/s'
set y2label 'RSS while loading, over the pool (MiB)'
set ytics nomirror
set y2tics
set yrange [0:*]
set y2range [0:80]
set title 'pinfeed-bench threads: throughput and memory against the thread count'
plot 'docs/figures/loader-threads.csv' using 1:2 skip 1 with linespoints lw 2 title 'loader images/s', 'docs/figures/loader-threads.csv' using 1:3 skip 1 with linespoints dt 2 title 'matching decode images/s', 'docs/figures/loader-threads.csv' using 1:7 skip 1 axes x1y2 with linespoints lw 2 title 'RSS over the pool', 64 axes x1y2 with lines dt 3 lc rgb 'red' title 'bound: pool + 64 MiB'
