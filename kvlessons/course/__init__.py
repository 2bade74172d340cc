"""Course tooling, not course content: what runs the course rather than what it teaches.

``environment`` (the check lesson 01 opens with), ``student`` (student copies of the
lessons, ``make student``), ``site`` (a static site of the executed lessons, ``make site``)
and ``links`` (the README's Colab/Binder badges and each lesson's Colab setup cell,
``make links``). The lessons' concepts live in the modules one level up.
"""
