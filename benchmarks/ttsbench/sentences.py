"""The built-in target texts of the default set: English and Chinese, short to long."""

SENTENCES: tuple[str, ...] = (
    "Hello there.",
    "The train leaves at seven fifteen.",
    "Could you please turn the music down a little?",
    "I left my umbrella at the office, so I got soaked on the way home.",
    "Our quarterly numbers look better than expected, mostly thanks to the new product line.",
    "When the storm finally passed, the whole village came out to clear the fallen branches from the road.",
    "She opened the old wooden box and found a stack of letters, each one tied with a faded blue ribbon.",
    "To reset your password, open the settings page, choose security, and follow the instructions in the email we send you.",
    "Scientists have long wondered how migrating birds find their way across thousands of kilometres of open ocean, "
    "and recent studies suggest they may sense the Earth's magnetic field.",
    "The museum will stay open late on Friday evenings this summer, with guided tours, live music in the courtyard, "
    "and a small market selling books and prints from local artists.",
    "你好。",
    "今天天气很好。",
    "请把窗户关上，外面有点冷。",
    "我们明天早上八点在学校门口见面，别迟到了。",
    "这家小店的面条做得特别好吃，每天中午都排着长长的队。",
    "会议推迟到下周三下午两点，请大家提前准备好各自负责的材料。",
    "他在旧书店里找到一本泛黄的笔记本，封面上写着一个他再熟悉不过的名字。",
    "随着城市不断扩张，越来越多的人开始选择在周末去郊外爬山、骑车，呼吸新鲜空气。",
    "这款应用可以帮助你记录每天的饮食和运动情况，并根据你的目标自动生成一份合理的健康计划。",
    "夜深了，窗外的雨还在不停地下着，她坐在灯下，一页一页地翻看着那些已经泛黄的老照片，"
    "回忆起许多年前在海边度过的那个夏天。",
)
